"""What the offline `LLM` (engine/llm.py) returns, and how it gets there: a prompt's
`GenerationResult` holds its `n` choices (`CompletionOutput`, vLLM's names), and a
`ChoiceText` turns one choice's engine outputs into its answer by the server's own logic
(engine/choices.py `answer_step`), so that the offline text is the server's for the same
request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from engine.choices import answer_step
from engine.detokenizer import SequenceDetokenizer
from engine.llm_params import SamplingParams
from engine.protocol import ErrorInfo, RequestOutput, TokenLogprob


@dataclass(frozen=True)
class CompletionOutput:
    """One choice of a prompt (vLLM's `CompletionOutput`). `token_ids` end with the EOS or
    stop token that ended the choice (whose text is left out), and stop at the token that
    completed a stop string; `logprobs` are theirs."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: ErrorInfo | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the chosen tokens' logprobs (None without `logprobs`)."""
        if self.logprobs is None:
            return None
        return sum(entry.logprob for entry in self.logprobs)


@dataclass(frozen=True)
class GenerationResult:
    """The finished output of one prompt. `outputs`: its `n` choices (vLLM's
    `RequestOutput.outputs`); the fields `token_ids` to `error` and `stop_reason` are the
    first choice's, or the error's of a prompt refused before it ran."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    error: ErrorInfo | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (SamplingParams)
    stop_reason: str | int | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt: str | None = None  # vLLM's: the prompt string, a chat's rendering, None for ids
    finished: bool = True  # vLLM's; an offline result is always whole
    num_cached_tokens: int | None = None  # vLLM's: prompt tokens the prefix cache served

    @classmethod
    def of_choices(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        outputs: list[CompletionOutput],
        prompt_logprobs: list[TokenLogprob] | None = None,
        prompt: str | None = None,
        num_cached_tokens: int | None = None,
    ) -> GenerationResult:
        first = outputs[0]
        return cls(request_id, prompt_token_ids, first.token_ids, first.text,
                   first.finish_reason, first.logprobs, first.error, prompt_logprobs,
                   first.stop_reason, outputs, prompt,
                   num_cached_tokens=num_cached_tokens)  # fmt: skip


class ChoiceText:
    """One choice while it runs: its outputs through the server's text logic. Without stop
    strings nothing can end it early, and its outputs wait to be decoded in one go when it
    ends (as the server's non-streaming answers are: the text does not depend on how the
    tokens came), not token by token in the engine loop."""

    def __init__(self, index: int, detokenizer: SequenceDetokenizer, has_stops: bool) -> None:
        self.index = index
        self.detokenizer = detokenizer
        self.has_stops = has_stops
        self.waiting: list[RequestOutput] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.has_logprobs = False
        self.text = ""
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.num_cached_tokens = 0
        self.done: CompletionOutput | None = None

    def add(
        self,
        output: RequestOutput,
        sampling: SamplingParams,
        eos_token_ids: Sequence[int],
        tokenizer_eos: int | None = None,
    ) -> bool:
        """Takes one engine output; whether the choice ended on a stop string before the
        engine finished it (the caller aborts it, as the server does)."""
        if output.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = output.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if not self.has_stops and output.finish_reason is None and output.error is None:
            self.waiting.append(output)
            return False
        if self.waiting:
            output = _merged([*self.waiting, output])
            self.waiting = []
        if output.error is not None:  # the tokens before it stay, as the engine sent them
            text = self.detokenizer.step(output.new_token_ids) + self.detokenizer.finish()
            self._take(output, len(output.new_token_ids), text)
            self._finish("error", None, output.error)
            return False
        step = answer_step(self.detokenizer, output, sampling, eos_token_ids, tokenizer_eos)
        self._take(output, step.num_tokens, step.text)
        if step.finish_reason is None:
            return False
        self._finish(step.finish_reason, step.stop_reason, None)
        return output.finish_reason is None

    def _take(self, output: RequestOutput, num_tokens: int, text: str) -> None:
        self.text += text
        self.token_ids += output.new_token_ids[:num_tokens]
        if output.logprobs is not None:
            self.has_logprobs = True
            self.logprobs += output.logprobs[:num_tokens]

    def _finish(self, reason: str, stop_reason: str | int | None, error: ErrorInfo | None) -> None:
        self.done = CompletionOutput(self.index, self.text, self.token_ids, reason,
                                     self.logprobs if self.has_logprobs else None,
                                     stop_reason, error)  # fmt: skip


def _merged(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: the last, with all their tokens."""
    has_logprobs = any(output.logprobs is not None for output in outputs)
    return msgspec.structs.replace(
        outputs[-1],
        new_token_ids=[t for output in outputs for t in output.new_token_ids],
        logprobs=[lp for o in outputs for lp in o.logprobs or []] if has_logprobs else None,
    )
