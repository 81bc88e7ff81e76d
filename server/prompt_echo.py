"""What a completion choice shows of its prompt: OpenAI's `echo` and vLLM's
`prompt_logprobs` (the engine scores the prompt: engine/prompt_logprobs.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from engine.multimodal.prompt import PromptProcessor
from engine.protocol import TokenLogprob
from server.logprobs import completion_logprobs, echoed_prompt_logprobs, prompt_logprobs
from server.openai_models import CompletionRequest
from server.openai_replies import CompletionLogprobs


@dataclass(frozen=True)
class PromptEcho:
    """What a completion choice shows of its prompt, in its first chunk (or its whole
    answer): with `echo` the prompt's text before the completion's (and, with `logprobs`,
    the prompt tokens' logprobs first, the first one None), and vLLM's `prompt_logprobs`."""

    text: str | None  # echo: the prompt as given (token ids: decoded)
    num_logprobs: int | None  # the request's `logprobs`
    # The request's vLLM `prompt_logprobs`: the engine scored the prompt with as many
    # alternatives as the echo's `logprobs` asked for, if more (fuzz77: all went out).
    num_prompt_logprobs: int | None
    tokens_as_ids: bool = False  # return_tokens_as_token_ids

    @classmethod
    def of(cls, request: CompletionRequest, part: int, prompt_token_ids: list[int],
           processor: PromptProcessor, *, truncated: bool = False) -> PromptEcho:  # fmt: skip
        """The echo of prompt `part` of the request's batch. `truncated`:
        `truncate_prompt_tokens` cut the prompt, so the echo is the text of the tokens
        kept, not the prompt as given."""
        text = None
        if request.echo:
            # A text as given (fuzz103: a batch's texts were decoded from their ids, the
            # tokenizer's BOS in front of each); token ids decoded.
            prompt = request.prompts[part]
            text = prompt if isinstance(prompt, str) and not truncated else processor.decode(
                prompt_token_ids, skip_special_tokens=False
            )  # fmt: skip
        return cls(text, request.logprobs, request.prompt_logprobs,
                   request.return_tokens_as_token_ids)  # fmt: skip

    def logprobs(
        self, tokenizer: Tokenizer, entries: list[TokenLogprob], text_offsets: list[int]
    ) -> CompletionLogprobs:
        """The legacy logprobs of generated tokens whose text starts at `text_offsets` of
        the generated text (after the echo, if any)."""
        echoed = len(self.text or "")
        offsets = [echoed + offset for offset in text_offsets]
        return completion_logprobs(tokenizer, entries, offsets, as_ids=self.tokens_as_ids)

    def first(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        scores: list[TokenLogprob] | None,
        entries: list[TokenLogprob],
        text_offsets: list[int],
    ) -> tuple[str, CompletionLogprobs | None, list | None]:
        """The echoed text, the logprobs of it and of the first `entries` (their text at
        `text_offsets` of the generated text), and vLLM's prompt_logprobs."""
        echoed = self.text or ""
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = self.logprobs(tokenizer, entries, text_offsets)
            if self.text is not None:
                prompt = echoed_prompt_logprobs(tokenizer, prompt_token_ids, scores or [],
                                                self.num_logprobs, self.text,
                                                as_ids=self.tokens_as_ids)  # fmt: skip
                logprobs = CompletionLogprobs(
                    tokens=prompt.tokens + logprobs.tokens,
                    token_logprobs=prompt.token_logprobs + logprobs.token_logprobs,
                    top_logprobs=prompt.top_logprobs + logprobs.top_logprobs,
                    text_offset=prompt.text_offset + logprobs.text_offset,
                )
        vllm_scores = None
        if self.num_prompt_logprobs is not None:
            vllm_scores = prompt_logprobs(tokenizer, scores or [], self.num_prompt_logprobs)
        return echoed, logprobs, vllm_scores
