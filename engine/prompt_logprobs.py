"""Prompt logprobs (vLLM's `prompt_logprobs`, and OpenAI's `echo` with `logprobs`): how
likely the model found each prompt token, given the tokens before it.

The hidden row of sequence position p is what the model predicts after tokens 0..p, so its
logits score prompt token p + 1; prompt token 0 has no score. A prefill chunk [start, end)
scores tokens start + 1 .. min(end, L - 1) (L prompt tokens) as it runs: the logits are
computed in slices of `SLICE_ROWS` rows (a [256, 151936] float32 slice is 155 MB, and a
2048-token chunk at once would be 1.2 GB), log-softmaxed raw (before penalties, bans or
grammars, as sampled tokens' logprobs are), and the prompt token's logprob, its rank (1 =
the most likely token) and the top-k alternatives are kept on the device until the step's
one host sync. `Request.prompt_logprobs` collects them; a request that wants them is not
served from the prefix cache past what it has scored (the cached rows have no logits), and
a preempted one does not score a token twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.device_io import to_device
from engine.protocol import TokenLogprob

SLICE_ROWS = 256


@dataclass(frozen=True)
class PendingPromptLogprobs:
    """One chunk's prompt-token scores, on the device until the step's result is read."""

    request_id: str
    first_index: int  # prompt index of the token the first row scores
    token_ids: list[int]  # the scored prompt tokens
    chosen: torch.Tensor  # [n] float32
    ranks: torch.Tensor  # [n] int64
    top_values: torch.Tensor  # [n, k] float32 (k may be 0)
    top_ids: torch.Tensor  # [n, k] int64

    def entries(self) -> list[TokenLogprob]:
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        top_values, top_ids = self.top_values.tolist(), self.top_ids.tolist()
        return [
            TokenLogprob(token_id, logprob, list(zip(ids, values, strict=True)), rank)
            for token_id, logprob, rank, ids, values in zip(
                self.token_ids, chosen, ranks, top_ids, top_values, strict=True
            )
        ]


def scored_positions(start: int, end: int, num_prompt: int, num_scored: int) -> range:
    """Positions p in [start, end) whose logits score a prompt token p + 1 not scored yet
    (tokens 1 .. num_scored are)."""
    return range(max(start, num_scored), min(end, num_prompt - 1))


def score_prompt_tokens(
    request_id: str,
    hidden: torch.Tensor,
    first_position: int,
    prompt_token_ids: list[int],
    num_top: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> PendingPromptLogprobs:
    """Scores prompt tokens first_position + 1 .. first_position + len(hidden) from the
    hidden rows of positions first_position .. (hidden: [n, hidden_size], n >= 1)."""
    targets_list = prompt_token_ids[first_position + 1 : first_position + 1 + hidden.shape[0]]
    targets = to_device(targets_list, torch.long, hidden.device)  # [n]
    chosen, ranks, top_values, top_ids = [], [], [], []
    for start in range(0, hidden.shape[0], SLICE_ROWS):
        logits = compute_logits(hidden[start : start + SLICE_ROWS]).float()  # [m, V]
        logprobs = torch.log_softmax(logits, dim=-1)
        target = targets[start : start + SLICE_ROWS].unsqueeze(1)  # [m, 1]
        token_logprob = logprobs.gather(1, target)  # [m, 1]
        chosen.append(token_logprob.squeeze(1))
        # vLLM's rank: the tokens at least as likely, itself and every tie included
        ranks.append((logprobs >= token_logprob).sum(dim=1))
        values, ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
        top_values.append(values)
        top_ids.append(ids)
    return PendingPromptLogprobs(
        request_id,
        first_position + 1,
        targets_list,
        torch.cat(chosen),
        torch.cat(ranks),
        torch.cat(top_values),
        torch.cat(top_ids),
    )
