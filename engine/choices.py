"""The `n` choices of one request, the same way on both paths that turn engine outputs into
answers: the server (server/generation.py) and the offline `LLM` (engine/llm.py).

* `fan_out`: one engine request per choice, `{id}-{i}` (the id alone when `n` is 1); a
  `seed` becomes `seed + i` on choice `i`, so that the choices differ yet each is
  reproducible (vLLM's children of `n > 1` do the same); the prompt's scores, the same for
  every choice, are computed by the first alone unless each must show them; a seed
  outside `SEED_RANGE` (`is_seed`, the engine's own check too) is not wrapped into it.
* `answer_step`: what one engine output adds to its choice's answer, through that choice's
  `SequenceDetokenizer`: the text, how many of the new tokens belong to the answer (none
  after the token that completes a stop string), and how the choice ends.

Pure code over engine.protocol and engine.detokenizer (no torch, no engine state): it lives
in engine/ because engine/ never imports server/, and both need exactly this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from engine.detokenizer import SequenceDetokenizer
from engine.protocol import EngineRequest, FinishReason, RequestOutput, SamplingParams

SEED_RANGE = (-(2**63), 2**63 - 1)  # what torch's manual_seed takes, as the HTTP API's


def is_seed(value: object) -> bool:
    """Whether `value` is a seed a request may carry: an int (not a bool) in SEED_RANGE."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and SEED_RANGE[0] <= value <= SEED_RANGE[1]
    )


def fan_out(
    request: EngineRequest, n: int, *, score_prompt_once: bool = True
) -> list[EngineRequest]:
    """The `n` engine requests of `request`'s choices (see the module docstring)."""
    if n == 1:
        return [request]
    sampling = request.sampling
    choices = []
    for i in range(n):
        params = sampling
        if sampling.seed is not None:
            # Same seed on every choice would make all n choices identical. Wrapped in the
            # int64 range the client's seed came from (2**63 - 1 + 1 was refused); a seed
            # from outside it stays outside, for the engine to refuse as it does with n 1
            # (wrapped, the offline LLM's seed 2**64 drew as seed 0; fuzz87).
            seed = sampling.seed + i
            params = msgspec.structs.replace(
                params, seed=_wrapped_int64(seed) if is_seed(sampling.seed) else seed
            )
        if i and score_prompt_once and sampling.prompt_logprobs is not None:
            params = msgspec.structs.replace(params, prompt_logprobs=None)
        choices.append(
            msgspec.structs.replace(
                request, request_id=f"{request.request_id}-{i}", sampling=params
            )
        )
    return choices


def _wrapped_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


@dataclass
class AnswerStep:
    """What one engine output added to a choice. `num_tokens`: how many of its new tokens
    the answer keeps (their logprobs too). `finish_reason`: None while the choice goes on;
    "stop" or "length" when it ended; "abort" or "error" when the engine ended it (the
    caller decides what that means: the server raises, the offline LLM reports it).
    `stop_reason`: vLLM's, the stop string or stop token id that ended it (None for the
    tokenizer's EOS, a grammar's end or the length limit; an EOS id of the model's other
    ones, such as generation_config.json's, counts as a stop token, as vLLM counts them)."""

    text: str
    num_tokens: int
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_offsets: list[int] = field(default_factory=list)  # with `track_offsets`


def answer_step(
    detokenizer: SequenceDetokenizer,
    output: RequestOutput,
    sampling: SamplingParams,
    eos_token_ids: Sequence[int] = (),
    tokenizer_eos: int | None = None,
) -> AnswerStep:
    """`output` (its error already dealt with by the caller) through `detokenizer`.
    `tokenizer_eos`: the tokenizer's EOS id, the one EOS whose stop_reason is None."""
    new_token_ids = output.new_token_ids
    # A stop token (stop_token_ids) or EOS ends the answer without its text, as vLLM's does
    # unless include_stop_str_in_output (whatever skip_special_tokens says); it still
    # counts, with its logprob (a stop token also as stop_reason).
    last = new_token_ids[-1] if new_token_ids else None
    ends_on_stop_token = (output.finish_reason == FinishReason.STOP and last is not None
                          and (last in sampling.stop_token_ids
                               or (last in eos_token_ids and not sampling.ignore_eos))
                          and not detokenizer.include_stop)  # fmt: skip
    first_offset = len(detokenizer.text_offsets or ())
    text, taken = detokenizer.step_until_stop(
        new_token_ids[:-1] if ends_on_stop_token else new_token_ids
    )
    if ends_on_stop_token and not detokenizer.is_stopped:
        detokenizer.note_token_offset()
        taken += 1
    finish_reason = stop_reason = None
    if detokenizer.is_stopped:
        finish_reason, stop_reason = "stop", detokenizer.matched_stop
    elif output.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
        finish_reason = output.finish_reason.value
    elif output.finish_reason is not None:
        text += detokenizer.finish()
        finish_reason = "length" if output.finish_reason == FinishReason.LENGTH else "stop"
        last = new_token_ids[taken - 1] if taken else None
        if detokenizer.is_stopped:  # a stop string only the flushed tail completed (fuzz113)
            finish_reason, stop_reason = "stop", detokenizer.matched_stop
        elif output.finish_reason == FinishReason.STOP and last is not None:
            # vLLM's rules (fuzz103, fuzz113): its EOS is the tokenizer's, checked before
            # the stop tokens, to which it adds the model's other EOS ids.
            is_eos = not sampling.ignore_eos
            if not (is_eos and last == tokenizer_eos) and (
                last in sampling.stop_token_ids or (is_eos and last in eos_token_ids)
            ):
                stop_reason = last
    return AnswerStep(
        text=text,
        num_tokens=taken,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        text_offsets=(detokenizer.text_offsets or [])[first_offset:],
    )
