"""The tokens each running request holds (its prompt and its outputs so far), kept on the
sampling device between steps, for the penalties.

The repetition penalty reads, for every row of every step, each token its request holds;
the presence and frequency penalties read its outputs. Building those ids on the host
each step costs host work that grows with prompts and outputs (a row's ids as a tensor,
then concatenated and copied over: ~0.3 ms a step at 128 rows of ~560 ids on one CPU
thread, several times that in parallel regions beside busy cores, docs/gpu.md
2026-11-27). Here a request's ids are written once, into its row (slot) of a device table,
when it first samples with a penalty; after that each step appends the token it samples,
on the device, behind the sampling itself. A step then only gathers its rows' slots: the
host work per step is a few small lists, whatever the lengths of prompts and outputs.

Columns past a row's count hold its first prompt token, a token it holds anyway: the
repetition penalty may read a row's every column and write each back, since a token held
twice is penalised to the same value twice. The outputs (`HeldRows.outputs`) are gathered
exactly, one entry per occurrence, since the frequency penalty counts them. The table
holds int32 ids and only grows: rows double as requests come, columns double up to the
longest sequence seen (256 rows of 32k tokens take 32 MB). Like CUDA graphs, it comes out
of the share of device memory that `gpu_memory_utilization` leaves outside the KV cache
(engine/kv_cache_sizing.py).

Bookkeeping (all on the host): a slot keeps its request across preemption (its tokens do
not change), and is freed once the request has finished. Each step checks that a slot
holds as many tokens as its request has on the host plus those still in flight; a slot
that does not (or a new request) is written again from the host's ids, and a token still
in flight is copied after them on the device, so what the table holds never depends on
every append having been seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.device_io import to_device

if TYPE_CHECKING:
    from engine.penalties import InFlightOutputs
    from engine.request import Request

MIN_WIDTH = 256  # columns of a new table; it doubles as sequences grow past it
MIN_SLOTS = 16


@dataclass(frozen=True)
class HeldRows:
    """Some rows of a step, each with its request's slot: what `index` returned. Their
    tokens for the penalties (`tokens`, `outputs`), and where `append` writes the tokens
    the step samples. Every slot holds its request's tokens in flight too."""

    rows_host: tuple[int, ...]  # rows of the logits
    slots_host: tuple[int, ...]
    counts_host: tuple[int, ...]  # tokens each slot holds before this step's
    prompt_lens_host: tuple[int, ...]  # where each slot's outputs start
    rows: torch.Tensor  # [P] int64 on the device
    slots: torch.Tensor  # [P] int64 on the device
    counts: torch.Tensor  # [P] int64 on the device: where each row's next token goes
    table: torch.Tensor  # [slots, W] int32 on the device: the table this step reads

    def tokens(self, positions: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """([P'] logits rows, [P', L] int32 ids): every token that the rows at `positions`
        of this (all of them by default) hold, prompt and outputs, each row padded with a
        token it holds anyway."""
        rows, slots = self.rows, self.slots
        if positions is None:
            positions = range(len(self.rows_host))
        elif len(positions) < len(self.rows_host):
            index = to_device(positions, torch.long, rows.device)
            rows, slots = rows.index_select(0, index), slots.index_select(0, index)
        width = max(self.counts_host[p] for p in positions)
        return rows, self.table.index_select(0, slots)[:, :width]

    def outputs(self, positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """([N] logits rows, [N] int64 ids): each output token that the rows at `positions`
        hold, one entry per occurrence (no padding). The host sends three numbers a row;
        the device expands them (`output_size` spares `repeat_interleave` its sync)."""
        width = self.table.shape[1]
        lengths = [self.counts_host[p] - self.prompt_lens_host[p] for p in positions]
        host = [[self.rows_host[p] for p in positions],
                [self.slots_host[p] * width + self.prompt_lens_host[p] for p in positions],
                lengths]  # fmt: skip
        rows, starts, lengths_on_device = to_device(host, torch.long, self.table.device)
        total = sum(lengths)
        # Entry k of a row is at starts + k: starts less the entries before the row, plus
        # the entry's place among all N.
        before = lengths_on_device.cumsum(0) - lengths_on_device
        flat = (starts - before).repeat_interleave(lengths_on_device, output_size=total)
        flat += torch.arange(total, device=flat.device)
        rows = rows.repeat_interleave(lengths_on_device, output_size=total)
        return rows, self.table.view(-1).index_select(0, flat).long()


class HeldTokens:
    """Per-request token ids on one device, one table row (slot) per request."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._table = torch.empty(0, MIN_WIDTH, dtype=torch.int32, device=device)
        self._slot_of: dict[str, int] = {}  # request_id -> slot
        self._owners: list[Request | None] = []  # slot -> request
        self._counts: list[int] = []  # slot -> tokens written
        self._free: list[int] = []

    @property
    def num_slots_in_use(self) -> int:
        return len(self._slot_of)

    def index(
        self, rows: list[tuple[int, Request]], in_flight: InFlightOutputs | None = None
    ) -> HeldRows:
        """The slots of (logits row, request) pairs, each request sampling this step;
        writes the ids of requests that have no slot yet (or a stale one) from the host,
        and their token in `in_flight` after them. Queues device work only."""
        self._free_finished()
        in_flight_of = (
            {} if in_flight is None else {r: i for i, r in enumerate(in_flight.rows_host)}
        )
        slots, counts = [], []
        for row, request in rows:
            # Tokens the table must hold: the host's, plus those sampled by steps still in
            # flight (the scheduler counts this step's token as pending too).
            expected = request.num_scheduled_tokens - 1
            slot = self._slot_of.get(request.request_id)
            if slot is None or self._owners[slot] is not request:
                slot = self._claim(request)
            if self._counts[slot] != expected:
                self._write(slot, request.prompt_token_ids + request.output_token_ids)
                if row in in_flight_of and self._counts[slot] + 1 == expected:
                    self._write_in_flight(slot, in_flight, in_flight_of[row])
            slots.append(slot)
            counts.append(self._counts[slot])
        self._ensure_width(max(counts) + 1)  # room for this step's token
        logits_rows = [row for row, _ in rows]
        host = to_device([logits_rows, slots, counts], torch.long, self.device)
        prompt_lens = tuple(len(request.prompt_token_ids) for _, request in rows)
        return HeldRows(tuple(logits_rows), tuple(slots), tuple(counts), prompt_lens,
                        host[0], host[1], host[2], self._table)  # fmt: skip

    def append(self, held_rows: HeldRows, sampled: torch.Tensor) -> None:
        """Writes each row's sampled token ([S] on the device) after its others."""
        tokens = sampled.index_select(0, held_rows.rows).to(torch.int32)
        self._table.index_put_((held_rows.slots, held_rows.counts), tokens)
        for slot in held_rows.slots_host:
            self._counts[slot] += 1

    def _claim(self, request: Request) -> int:
        stale = self._slot_of.pop(request.request_id, None)
        if stale is not None:  # another request object under the same id
            self._release(stale)
        if not self._free:
            self._grow_slots()
        slot = self._free.pop()
        self._slot_of[request.request_id] = slot
        self._owners[slot] = request
        return slot

    def _write(self, slot: int, token_ids: list[int]) -> None:
        self._ensure_width(len(token_ids) + 1)
        row = self._table[slot]
        row.fill_(token_ids[0])  # the padding: a token the row holds
        row[: len(token_ids)].copy_(to_device(token_ids, torch.int32, self.device))
        self._counts[slot] = len(token_ids)

    def _write_in_flight(self, slot: int, in_flight: InFlightOutputs, index: int) -> None:
        """Appends the token still in flight for the row at `index` of `in_flight` (on the
        device): without it a slot written while one is in flight would stay a token
        behind, and be written again every step."""
        count = self._counts[slot]
        self._table[slot, count : count + 1].copy_(in_flight.token_ids[index : index + 1])
        self._counts[slot] = count + 1

    def _free_finished(self) -> None:
        for request_id, slot in list(self._slot_of.items()):
            owner = self._owners[slot]
            if owner is None or owner.is_finished:
                del self._slot_of[request_id]
                self._release(slot)

    def _release(self, slot: int) -> None:
        self._owners[slot] = None
        self._counts[slot] = 0
        self._free.append(slot)

    def _grow_slots(self) -> None:
        old = len(self._owners)
        new = max(MIN_SLOTS, 2 * old)
        table = torch.empty(new, self._table.shape[1], dtype=torch.int32, device=self.device)
        table[:old] = self._table
        self._table = table
        self._owners += [None] * (new - old)
        self._counts += [0] * (new - old)
        self._free += range(new - 1, old - 1, -1)

    def _ensure_width(self, width: int) -> None:
        old = self._table.shape[1]
        if width <= old:
            return
        new = max(2 * old, width)
        table = torch.empty(self._table.shape[0], new, dtype=torch.int32, device=self.device)
        table[:, :old] = self._table
        table[:, old:] = self._table[:, :1]  # each row's padding: its first token
        self._table = table
