"""engine/token_bans.py: the tokens a row may not pick at one step."""

from __future__ import annotations

from types import SimpleNamespace

from engine.protocol import SamplingParams
from engine.token_bans import banned_token_ids

EOS = 7


def chunk_at(output_position: int, sampling: SamplingParams) -> SimpleNamespace:
    """The chunk that samples output token `output_position` of a 5-token prompt."""
    request = SimpleNamespace(sampling=sampling, num_prompt_tokens=5, eos_token_ids=(EOS,),
                              grammar_active=True)  # fmt: skip
    return SimpleNamespace(request=request, end=5 + output_position)


def test_min_tokens_bans_eos_even_with_ignore_eos():
    """As vLLM and transformers' min_new_tokens do: with ignore_eos an EOS does not end the
    answer, but it was let through min_tokens, where vLLM writes other tokens (fuzz103)."""
    for ignore_eos in (False, True):
        sampling = SamplingParams(min_tokens=2, ignore_eos=ignore_eos, stop_token_ids=(9,))
        assert set(banned_token_ids(chunk_at(1, sampling))) == {EOS, 9}
        assert banned_token_ids(chunk_at(2, sampling)) == ()
