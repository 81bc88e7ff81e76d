"""engine/prompt_logprobs.py: the scores of a prompt's own tokens."""

from __future__ import annotations

import torch

from engine.prompt_logprobs import score_prompt_tokens


def test_a_tied_tokens_rank_counts_every_token_as_likely_as_it():
    """vLLM ranks a token by how many tokens are at least as likely (ties count against
    it); Tessera counted only the likelier ones, plus one: rank 2 where vLLM says 4."""
    logits = torch.zeros(1, 8)
    logits[0, 0] = 5.0  # one clear winner
    logits[0, 1:4] = 1.0  # then three tied tokens
    scores = score_prompt_tokens("r", torch.zeros(1, 4), 0, [7, 3], 2, lambda hidden: logits)
    assert scores.ranks.tolist() == [4]
    winner = score_prompt_tokens("r", torch.zeros(1, 4), 0, [7, 0], 2, lambda hidden: logits)
    assert winner.ranks.tolist() == [1]
