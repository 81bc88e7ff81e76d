"""The flat batch of one step, gathered on the host from the scheduler's chunks.

Chunk i covers sequence positions [start, end) of its request; its `end - start` tokens
are rows `query_start_loc[i] : query_start_loc[i + 1]` of the flat batch (layout in
engine/attention/base.py). Prompt tokens take their precomputed M-RoPE positions; tokens
past the prompt sit at `index + rope_delta` in all three rows. A media span overlapping a
chunk contributes the encoder rows of its overlap, scattered into the chunk's placeholder
rows by the model.

Everything here is host data (lists, CPU tensors) except the encoder rows, which already
live on the model's device; the model runner moves the rest in one go. A decode row whose
token the step in flight is still sampling (overlap scheduling) holds 0 here and is listed
in `pending_rows`; the runner writes the token in on the device (`InFlightTokens`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from engine.encoder_cache import EncoderCache
from engine.scheduler_output import ScheduledChunk


@dataclass(frozen=True)
class StepInputs:
    input_ids: list[int]  # [T]
    positions: torch.Tensor  # [3, T] int64, CPU
    slot_mapping: list[int]  # [T] KV slot of each token
    query_lens: list[int]  # [S]
    seq_lens: list[int]  # [S] history including this step's tokens
    block_tables: list[list[int]]  # [S] block ids of each sequence, history order
    multimodal_embeds: list[torch.Tensor]  # each [rows, hidden] on the model's device
    multimodal_rows: list[int]  # flat row of every embedded row, in order
    # Rows whose token is still being sampled by the step in flight (overlap scheduling):
    # input_ids holds 0 there; the runner copies the token in on the device.
    pending_rows: list[int] = field(default_factory=list)
    pending_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @property
    def query_ends(self) -> list[int]:
        """query_start_loc[1:]: one past the last row of each sequence."""
        return list(itertools.accumulate(self.query_lens))


def gather_step_inputs(
    chunks: list[ScheduledChunk], block_size: int, encoder_cache: EncoderCache
) -> StepInputs:
    input_ids: list[int] = []
    prompt_positions: list[tuple[int, torch.Tensor]] = []  # (first flat row, [3, n])
    later_rows: list[int] = []  # flat rows of tokens past the prompt
    later_positions: list[int] = []
    slot_mapping: list[int] = []
    embeds: list[torch.Tensor] = []
    embed_rows: list[int] = []
    pending_rows: list[int] = []
    pending_request_ids: list[str] = []
    for chunk in chunks:
        request = chunk.request
        start = chunk.start
        end = start + chunk.num_tokens
        block_ids = request.block_ids
        base = len(input_ids)
        if end - start == 1 and start >= request.media_end:  # a decode row: the hot path
            num_tokens = request.num_tokens
            if end > num_tokens:  # its token is in flight
                pending_rows.append(base)
                pending_request_ids.append(request.request_id)
                input_ids.append(0)
            else:
                input_ids += request.token_ids_between(start, end)
            if start < request.num_prompt_tokens:  # the prompt's last token
                prompt_positions.append((base, request.positions[:, start:end]))
            else:
                later_rows.append(base)
                later_positions.append(start + request.rope_delta)
            slot_mapping.append(block_ids[start // block_size] * block_size + start % block_size)
            continue
        input_ids += request.token_ids_between(start, end)
        if end > request.num_tokens:  # the last row's token is in flight
            pending_rows.append(len(input_ids))
            pending_request_ids.append(request.request_id)
            input_ids.append(0)
        num_prompt = request.num_prompt_tokens
        if start < num_prompt:
            prompt_end = min(end, num_prompt)
            prompt_positions.append((base, request.positions[:, start:prompt_end]))
        for index in range(max(start, num_prompt), end):
            later_rows.append(base + index - start)
            later_positions.append(index + request.rope_delta)
        slot_mapping += [
            block_ids[i // block_size] * block_size + i % block_size for i in range(start, end)
        ]
        for media in request.media_overlapping(start, end):
            lo, hi = max(start, media.offset), min(end, media.end)
            rows = encoder_cache.get(media.content_hash)
            embeds.append(rows[lo - media.offset : hi - media.offset])
            embed_rows.extend(range(base + lo - start, base + hi - start))
    positions = _positions(len(input_ids), prompt_positions, later_rows, later_positions)
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_lens=[chunk.num_tokens for chunk in chunks],
        seq_lens=[chunk.end for chunk in chunks],
        block_tables=[chunk.request.block_ids for chunk in chunks],
        multimodal_embeds=embeds,
        multimodal_rows=embed_rows,
        pending_rows=pending_rows,
        pending_request_ids=pending_request_ids,
    )


def _positions(
    num_rows: int,
    prompt_positions: list[tuple[int, torch.Tensor]],
    later_rows: list[int],
    later_positions: list[int],
) -> torch.Tensor:  # [3, num_rows] int64
    """The step's M-RoPE positions: prompt pieces copied in, later tokens on all three rows."""
    if len(later_rows) == num_rows:  # decode-only: one tensor, no scatter
        return torch.tensor(later_positions, dtype=torch.long).expand(3, num_rows).contiguous()
    positions = torch.empty(3, num_rows, dtype=torch.long)
    for base, piece in prompt_positions:  # piece [3, n]
        positions[:, base : base + piece.shape[1]] = piece
    if later_rows:
        positions[:, later_rows] = torch.tensor(later_positions, dtype=torch.long)
    return positions


@dataclass(frozen=True)
class InFlightTokens:
    """Tokens of the step in flight that are inputs of the next one, kept on the device."""

    rows: torch.Tensor  # [P] int64: flat rows of the next step's input_ids
    token_ids: torch.Tensor  # [P] int64: the sampled tokens for those rows

    def write_into(self, input_ids: torch.Tensor) -> None:
        """Fills the rows' placeholders (queued on the device, no host sync)."""
        input_ids.index_copy_(0, self.rows, self.token_ids)
