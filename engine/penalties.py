"""The sampling penalties, in place on a step's [S, V] logits, touching only the tokens
a row holds: HF's repetition penalty over each row's prompt and outputs, then OpenAI's
presence and frequency penalties over its outputs (the order engine/sampler.py applies
them in).

A row's tokens come from one of three places: the sampler's device table
(engine/held_tokens.py, rows of the engine's requests), the row's own id lists (callers
without requests), and, for a token that the step in flight sampled and the host has not
seen yet (overlap scheduling), `InFlightOutputs`, on the device. The table holds its rows'
tokens in flight already, so those count once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.device_io import to_device

if TYPE_CHECKING:
    from engine.held_tokens import HeldRows
    from engine.sampler import SamplingRow
    from engine.scheduler_output import ScheduledChunk
    from engine.step_inputs import InFlightTokens, StepInputs


@dataclass(frozen=True)
class InFlightOutputs:
    """The newest output token of some rows, still on the device: the step in flight
    sampled it, and it is not in their `output_token_ids` yet (overlap scheduling). The
    penalties count it as an output."""

    rows: torch.Tensor  # [P] int64: rows of the logits
    token_ids: torch.Tensor  # [P] int64
    rows_host: tuple[int, ...] = ()  # `rows` on the host, where the caller knows them

    @property
    def has_unnamed_rows(self) -> bool:
        """Tokens are in flight on rows the caller did not name on the host."""
        return bool(self.rows.numel()) and not self.rows_host


def in_flight_outputs(
    sampling: list[tuple[int, ScheduledChunk]],
    inputs: StepInputs,
    in_flight: InFlightTokens | None,
    device: torch.device,
) -> InFlightOutputs | None:
    """The newest output token of each sampling row whose request has one in flight (the
    previous step sampled it and it is not in `output_token_ids` yet), for the penalties;
    None when no row has penalties or no token is in flight."""
    if in_flight is None or not any(c.request.sampling.has_penalties for _, c in sampling):
        return None
    position = {request_id: i for i, request_id in enumerate(inputs.pending_request_ids)}
    pairs = [
        (row, position[chunk.request.request_id])
        for row, (_, chunk) in enumerate(sampling)
        if chunk.request.request_id in position
    ]
    if not pairs:
        return None
    host_rows, host_sources = zip(*pairs, strict=True)
    rows, sources = to_device([host_rows, host_sources], torch.long, device)  # [2, P]
    return InFlightOutputs(rows, in_flight.token_ids.index_select(0, sources), host_rows)


def apply_penalties(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    in_flight: InFlightOutputs | None = None,
    in_place: bool = False,
    held_rows: HeldRows | None = None,
) -> torch.Tensor:
    """Repetition (HF), presence and frequency (OpenAI) penalties; [S, V] -> [S, V]. The
    outputs so far are each row's `output_token_ids` plus its token in `in_flight`; rows in
    `held_rows` read their tokens from the sampler's device table instead.
    `in_place`: `logits` is the caller's own copy and may be written (a float32 [128,
    152k] copy is ~20 ms on a CPU); otherwise the result is a new tensor."""
    params = [row.params for row in rows]
    if not any(p.has_penalties for p in params):
        return logits
    if held_rows is not None and in_flight is not None and in_flight.has_unnamed_rows:
        # The table holds its rows' tokens in flight: counting them again needs their rows.
        raise ValueError("held_rows with tokens in flight need in_flight.rows_host")
    if not (in_place and logits.is_contiguous()):
        logits = logits.clone(memory_format=torch.contiguous_format)
    if any(p.repetition_penalty != 1.0 for p in params):
        _apply_repetition_penalty(logits, rows, in_flight, held_rows)
    if any(p.has_output_penalties for p in params):
        _apply_presence_and_frequency(logits, rows, in_flight, held_rows)
    return logits


LOGIT_LIMIT = 1e30  # the largest |logit| a repetition penalty leaves


def _apply_repetition_penalty(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    in_flight: InFlightOutputs | None,
    held_rows: HeldRows | None,
) -> None:
    """HF's repetition penalty, in place on contiguous [S, V] logits: each token a row's
    prompt or output holds is divided by the row's penalty where positive, multiplied
    where not. Only those tokens are read and written (gather, penalise, scatter), not the
    whole [S, V]: with a dense "seen" mask over 152k tokens, its `where`, `gt` and `div`
    alone took 0.34 ms of device time a step at 128 rows on an H100 (docs/gpu.md,
    2026-11-27). A token held twice gets the same value twice, so duplicates need no
    dedup: the table's padding, and a token in flight that the table holds already."""
    vocab = logits.shape[1]
    device = logits.device
    penalties = to_device([row.params.repetition_penalty for row in rows], logits.dtype, device)
    indices, factors = [], []  # flat indices (row * V + token) and each one's penalty
    if held_rows is not None:
        positions = [p for p, r in enumerate(held_rows.rows_host)
                     if rows[r].params.repetition_penalty != 1.0]  # fmt: skip
        if positions:
            held_at, held = held_rows.tokens(positions)  # [P], [P, L]: the table's ids
            flat = held_at.unsqueeze(1) * vocab + held
            indices.append(flat.flatten())
            factors.append(penalties.index_select(0, held_at).unsqueeze(1).expand_as(flat))
    covered = set(held_rows.rows_host) if held_rows is not None else set()
    pieces, row_starts, lengths = [], [], []
    for index, row in enumerate(rows):
        if row.params.repetition_penalty == 1.0 or index in covered:
            continue
        for ids in (row.prompt_token_ids, row.output_token_ids):
            pieces.append(torch.as_tensor(ids, dtype=torch.long))  # kept tensors as they are
            row_starts.append(index * vocab)
            lengths.append(len(ids))
    if pieces:
        repeats = torch.tensor(lengths)
        host_index = torch.cat(pieces) + torch.tensor(row_starts).repeat_interleave(repeats)
        row_index = to_device(host_index, torch.long, device)
        indices.append(row_index)
        factors.append(penalties.index_select(0, row_index // vocab))
    if in_flight is not None:  # one more output per row, on the device (no sync)
        indices.append(in_flight.rows * vocab + in_flight.token_ids)
        factors.append(penalties.index_select(0, in_flight.rows))
    index = torch.cat(indices)
    penalty = torch.cat([factor.flatten() for factor in factors])
    flat_logits = logits.view(-1)
    seen = flat_logits.index_select(0, index)
    penalised = torch.where(seen > 0, seen / penalty, seen * penalty)
    # A penalty near 0 divides a positive logit past float32 (inf: softmax NaN, then a
    # garbage token), and one past float32 multiplies a zero logit by inf (NaN). Held to
    # LOGIT_LIMIT, a rewarded token still wins, and a division by the smallest temperature
    # (1e-5, engine/protocol.py) stays finite. A punished one stays a number too: at -inf,
    # a row whose allowed tokens were all punished had nothing left to pick but a token
    # it does not allow. A logit that was -inf stays so.
    penalised.nan_to_num_(nan=0.0, posinf=LOGIT_LIMIT, neginf=-LOGIT_LIMIT)
    penalised.clamp_(min=-LOGIT_LIMIT, max=LOGIT_LIMIT).masked_fill_(seen.isneginf(), -math.inf)
    flat_logits.index_copy_(0, index, penalised)


def _apply_presence_and_frequency(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    in_flight: InFlightOutputs | None,
    held_rows: HeldRows | None,
) -> None:
    """OpenAI's presence and frequency penalties over the outputs, in place on contiguous
    [S, V] logits: each token a row has output c > 0 times loses frequency * c, then
    presence. Only those tokens are read and written: their (row, token) pairs, one per
    occurrence, sorted, each counted by the length of its run; every occurrence then
    writes its pair's same value. No [S, V] count: dense, it took 186 against 44 ms a step
    for greedy at 128 rows x 152k on one CPU thread (bench/sampler.py). Bit for bit the
    dense arithmetic, which subtracted frequency * count and then presence * 1."""
    vocab = logits.shape[1]
    device = logits.device
    wanted = {index for index, row in enumerate(rows) if row.params.has_output_penalties}
    covered = set(held_rows.rows_host) if held_rows is not None else set()
    keys = []  # row * V + token, one per output occurrence
    if held_rows is not None:
        positions = [p for p, r in enumerate(held_rows.rows_host) if r in wanted]
        if positions:  # the table holds their tokens in flight too
            output_rows, output_ids = held_rows.outputs(positions)
            keys.append(output_rows * vocab + output_ids)
    listed = [np.asarray(rows[index].output_token_ids, dtype=np.int64) + index * vocab
              for index in sorted(wanted - covered)]  # fmt: skip
    if listed:
        keys.append(to_device(torch.from_numpy(np.concatenate(listed)), torch.long, device))
    if in_flight is not None:  # one more output on some rows, on the device (no sync)
        flying_rows, flying_ids = in_flight.rows, in_flight.token_ids
        if in_flight.rows_host:
            keep = [
                k for k, r in enumerate(in_flight.rows_host) if r in wanted and r not in covered
            ]
            index = to_device(keep, torch.long, device)
            flying_rows = flying_rows.index_select(0, index)
            flying_ids = flying_ids.index_select(0, index)
        keys.append(flying_rows * vocab + flying_ids)  # a row without penalties loses 0
    if not keys:
        return
    key = torch.cat(keys).sort().values  # [N]
    starts_run = torch.ones_like(key, dtype=torch.bool)
    starts_run[1:] = key[1:] != key[:-1]
    run = starts_run.cumsum(0) - 1  # [N]: which (row, token) pair each occurrence is
    counts = torch.zeros(key.shape, dtype=logits.dtype, device=device)
    counts = counts.index_add_(0, run, torch.ones_like(counts)).index_select(0, run)
    params = [row.params for row in rows]
    presence = to_device([p.presence_penalty for p in params], logits.dtype, device)
    frequency = to_device([p.frequency_penalty for p in params], logits.dtype, device)
    row_of = key // vocab
    flat_logits = logits.view(-1)
    penalised = flat_logits.index_select(0, key) - frequency.index_select(0, row_of) * counts
    penalised -= presence.index_select(0, row_of)
    flat_logits.index_copy_(0, key, penalised)
