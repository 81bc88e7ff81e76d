"""Token sampling, vectorised over the rows of one step.

Order of operations per row (as transformers' processors run them; vLLM v1 applies min-p
before top-k and top-p, which differs where both cut):
    raw logits --log_softmax--> logprobs (reported)
    raw logits -> logit_bias (added) -> repetition penalty (prompt + output tokens, HF:
                  divide positive, multiply negative) -> presence / frequency penalties
                  (output tokens) -> banned tokens (-inf: EOS and stop tokens before
                  `min_tokens`) -> grammar (-inf: tokens a structured output disallows)
               -> greedy rows: argmax
               -> random rows: / temperature -> top-k (every token tied with the k-th
                  kept) -> top-p -> min-p -> softmax
                  -> exponential race: argmax(probs / E), E ~ Exp(1) (E at least the
                     smallest normal float: a 0 from the generator would make a removed
                     token's 0 / 0 a NaN, which argmax picks)
The masks come last, but a penalty never turns -inf into a number, so that is the order
vLLM runs them in too (allowed tokens and bans before the bias).
Rows with a seed draw E from their request's own generator, so their tokens do
not depend on what else is in the batch. `sample()` only queues device work; the one
host sync of a step is `PendingSample.result()`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.device_io import HostCopy, copy_to_host, to_device
from engine.held_tokens import HeldRows, HeldTokens
from engine.penalties import InFlightOutputs, apply_penalties
from engine.protocol import SamplingParams, TokenLogprob
from engine.request import seeded_generator

if TYPE_CHECKING:
    from engine.request import Request


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    prompt_token_ids: Sequence[int] | torch.Tensor  # lists, or int64 host tensors
    output_token_ids: Sequence[int] | torch.Tensor
    generator: torch.Generator | None = None  # a seeded request's, on the logits' device
    banned_token_ids: tuple[int, ...] = ()  # may not be picked (`min_tokens` not reached)
    # [ceil(V / 32)] int32 host bitmask of the only tokens a grammar and `allowed_token_ids`
    # allow (bit t % 32 of word t // 32 is token t); None = unconstrained. See
    # engine/structured_output.py and `token_bitmask`.
    allowed_tokens: torch.Tensor | None = None
    # The engine's request, whose tokens the penalties then read from the sampler's device
    # table (engine/held_tokens.py) rather than from the ids above.
    request: Request | None = None


# The most candidates a row may keep (top_k) for the random draw to run over a top-k of
# the logits instead of the whole vocabulary (Sampler._sample_random).
TOP_K_CANDIDATES = 1024
# Candidates past a row's top_k, so tokens tied with the k-th logit are kept, as
# transformers and vLLM keep them (a value cut, not a rank cut; bf16 logits tie often).
# Past this many ties, the candidate path keeps only the first of them.
TOP_K_TIE_ROOM = 32


def _candidate_width(top_k: int, vocab: int) -> int:
    """How many of the best logits a row with this top_k races over (`_draw`)."""
    return min(top_k + TOP_K_TIE_ROOM, vocab)


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass(frozen=True)
class PendingSample:
    """One step's samples, still on the device. `result()` reads them back: the step's one
    host sync (everything before it is queued without waiting)."""

    packed: HostCopy  # [S, 1 + (1 + 2 * num_top if logprobs)] float64 (int64 if not)
    params: list[SamplingParams]
    num_top: int  # top-logprob columns in `packed`
    token_ids: torch.Tensor  # [S] int64 on the device: the next step's inputs, unread

    def result(self) -> SamplerOutput:
        packed = self.packed.get()  # the step's one host sync
        host = packed.tolist()  # float64 keeps token ids exact
        params = self.params
        if packed.dtype != torch.float64:  # no row asked for logprobs
            return SamplerOutput([int(row[0]) for row in host], [None] * len(params))
        token_ids, logprobs = [], []
        width = self.num_top
        for row, param in zip(host, params, strict=True):
            token_ids.append(int(row[0]))
            if param.logprobs is None:
                logprobs.append(None)
                continue
            n = min(param.logprobs, width)
            top = [(int(row[2 + i]), row[2 + width + i]) for i in range(n)]
            logprobs.append(TokenLogprob(int(row[0]), row[1], top))
        return SamplerOutput(token_ids, logprobs)


class Sampler:
    """Samples one token per row of a [S, V] logits tensor."""

    def __init__(self, seed: int = 0) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}
        self._held: dict[torch.device, HeldTokens] = {}
        self._seed = seed

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = seeded_generator(self._seed, device)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        return self.sample(logits, rows).result()

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        in_flight: InFlightOutputs | None = None,
    ) -> PendingSample:
        """Queues the sampling of every row; no host sync. `logits` [S, V] in any float
        dtype: what computes with them does so in float32, as transformers does."""
        owned = False  # whether `logits` is this call's own copy, free to write
        if logits.dtype != torch.float32 and not _argmax_in_model_dtype(logits, rows):
            logits, owned = logits.float(), True
        vocab = logits.shape[1]
        device = logits.device
        params = [row.params for row in rows]
        num_top = min(max((p.logprobs or 0) for p in params), vocab)
        wants_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None  # [S, V]

        held_rows = self._held_rows(rows, device, in_flight)
        biased = apply_logit_bias(logits, params)  # a new tensor when any row has a bias
        owned = owned or biased is not logits
        logits = apply_penalties(biased, rows, in_flight, owned, held_rows)
        logits = apply_allowed_tokens(apply_bans(logits, rows), rows)
        sampled = logits.argmax(dim=-1)  # [S]
        if not all(p.is_greedy for p in params):
            greedy = to_device([p.is_greedy for p in params], torch.bool, device)  # [S]
            random_ids = self._sample_random(logits, rows)  # [S]
            sampled = torch.where(greedy, sampled, random_ids)
        if held_rows is not None:
            self._held[device].append(held_rows, sampled)

        if raw_logprobs is None:
            return PendingSample(copy_to_host(sampled.unsqueeze(1)), params, 0, sampled)
        chosen = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [S, 1]
        packed = [sampled.unsqueeze(1).double(), chosen.double()]
        if num_top > 0:
            top_values, top_ids = raw_logprobs.topk(num_top, dim=-1)  # [S, N]
            packed += [top_ids.double(), top_values.double()]
        return PendingSample(copy_to_host(torch.cat(packed, dim=1)), params, num_top, sampled)

    def _held_rows(
        self, rows: list[SamplingRow], device: torch.device, in_flight: InFlightOutputs | None
    ) -> HeldRows | None:
        """The device table's rows for the rows whose request has a penalty. None where a
        token is in flight on rows the caller did not name (`rows_host`): the table could
        not tell whether it holds them."""
        pairs = [
            (index, row.request)
            for index, row in enumerate(rows)
            if row.request is not None and row.params.has_penalties
        ]
        if not pairs or (in_flight is not None and in_flight.has_unnamed_rows):
            return None
        if device not in self._held:
            self._held[device] = HeldTokens(device)
        return self._held[device].index(pairs, in_flight)

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One token per row ([S]), drawn from its processed logits under its temperature,
        top-k, top-p and min-p. Rows without a seed draw together from the engine's random
        stream. A seeded row draws from its own, with the arithmetic it would have alone, so
        that its tokens depend on nothing but its request: seeded rows draw in groups whose
        rows would each take the same path alone (`_draw_shape`), one batched draw a group,
        each row's noise from its own generator. (One draw a seeded row, as before, was ~15
        small ops a row and step: 7.2 against 1.1 ms for 128 rows of Qwen3-VL's defaults at
        a 2000-token vocabulary on one CPU thread, launches on a GPU.)"""
        device, vocab = logits.device, logits.shape[1]
        groups: dict[tuple[bool, int, bool], list[int]] = {}
        for index, row in enumerate(rows):
            if row.generator is not None and not row.params.is_greedy:
                groups.setdefault(_draw_shape(row.params, vocab), []).append(index)
        params = [row.params for row in rows]
        if sum(len(members) for members in groups.values()) < len(rows):
            # Rows without a seed: the whole batch draws from the engine's stream, as with no
            # seeds at all, without copying the logits (a copy of 127 of 128 rows of 152k
            # cost 31 ms on one CPU thread); the seeded rows' picks are replaced below.
            picked = _draw(logits, params, self._generator(device))
        elif len(groups) == 1:  # every row seeded, in one group: no copy either
            return _draw(logits, params, [row.generator for row in rows])
        else:
            picked = torch.empty(len(rows), dtype=torch.long, device=device)
        for members in groups.values():
            index = to_device(members, torch.long, device)
            own = [rows[i].generator for i in members]  # each seeded: not None
            drawn = _draw(logits.index_select(0, index), [params[i] for i in members], own)
            picked = picked.index_copy(0, index, drawn)
        return picked


def _draw_shape(params: SamplingParams, vocab: int) -> tuple[bool, int, bool]:
    """What decides the arithmetic of a row's draw alone (`_draw` with it as the only row):
    whether it races a top-k of candidates, over how many, and whether a top-p nucleus is
    cut (beside a row that cuts one, a row with top_p 1 would be cut at a mass of 1, which
    rounding can reach before the last token)."""
    over_candidates = 0 < params.top_k <= TOP_K_CANDIDATES
    width = _candidate_width(params.top_k, vocab) if over_candidates else vocab
    return over_candidates, width, params.top_p < 1.0


def _draw(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generator: torch.Generator | list[torch.Generator] | None,
) -> torch.Tensor:  # [S, V] -> [S]
    """Exponential race over the probabilities (the Gumbel-max trick). Where every random
    row keeps at most TOP_K_CANDIDATES tokens (top_k), only those candidates are scaled,
    normalised and raced, not the vocabulary: the same distribution without a sort over
    [S, V] (Qwen3-VL's defaults, top_k 20 and top_p 0.8: 377 against 11 ms a step for 32
    rows of 152k logits on one CPU thread). `generator`: the stream of every row's noise, or
    one per row (each row's noise then as it would be drawn for that row alone)."""
    device = logits.device
    temperature = to_device(
        [1.0 if p.is_greedy else p.temperature for p in params], logits.dtype, device
    )
    top_k = [1 if p.is_greedy else p.top_k for p in params]
    candidates = None
    if all(0 < k <= TOP_K_CANDIDATES for k in top_k):
        width = _candidate_width(max(top_k), logits.shape[1])
        logits, candidates = logits.topk(width, dim=-1)  # [S, K] each, best first
        logits = mask_sorted_top_k_top_p(logits / temperature.unsqueeze(1), params)
    else:
        logits = apply_top_k_top_p(logits / temperature.unsqueeze(1), params)  # [S, V]
    probs = torch.softmax(logits, dim=-1)  # [S, V], or [S, K] over the candidates
    min_p = [p.min_p for p in params]
    if any(m > 0 for m in min_p):
        threshold = to_device(min_p, probs.dtype, device).unsqueeze(1) * probs.amax(-1, True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    noise = torch.empty_like(probs)
    if isinstance(generator, list):
        for row, own in zip(noise, generator, strict=True):
            row.exponential_(generator=own)
    else:
        noise.exponential_(generator=generator)
    # A zero draw (CUDA's exponential_ has produced them, pytorch#20179) would turn a
    # removed token's 0 / 0 into a NaN, which argmax picks: keep E positive.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    picked = (probs / noise).argmax(dim=-1)  # [S]
    if candidates is None:
        return picked
    return candidates.gather(1, picked.unsqueeze(1)).squeeze(1)


def _argmax_in_model_dtype(logits: torch.Tensor, rows: list[SamplingRow]) -> bool:
    """A GPU batch of rows that only read which logit is largest takes the argmax of the
    model's bf16 / fp16 logits as they are: casting to float32 is exact, so the token is
    the same, and the batch skips the [S, V] float32 copy (at batch 128 and Qwen2's
    151,936 tokens, 78 MB written and read again per step). Not on a CPU, whose bf16
    argmax is not vectorised: 16 against 4.8 ms for the cast and a float32 argmax at
    32 x 151,936 on one thread."""
    return logits.device.type == "cuda" and all(_plain_greedy(row) for row in rows)


def _plain_greedy(row: SamplingRow) -> bool:
    """The row only reads which logit is largest (no logprobs, penalties, biases, bans or
    grammar)."""
    params = row.params
    return (
        params.is_greedy
        and params.logprobs is None
        and not params.has_penalties
        and not params.logit_bias
        and not row.banned_token_ids
        and row.allowed_tokens is None
    )


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's `logit_bias` added to its tokens' logits; [S, V] -> a new [S, V] (the raw
    logits stay as they were, for the reported logprobs)."""
    if not any(p.logit_bias for p in params):
        return logits
    rows, token_ids, biases = [], [], []
    for row, p in enumerate(params):
        for token_id, bias in p.logit_bias:
            rows.append(row)
            token_ids.append(token_id)
            biases.append(bias)
    device = logits.device
    index = (to_device(rows, torch.long, device), to_device(token_ids, torch.long, device))
    return logits.index_put(index, to_device(biases, logits.dtype, device), accumulate=True)


def apply_bans(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's `banned_token_ids` masked to -inf; [S, V] -> [S, V] (a new tensor when
    any row bans something). Ids past the logits cannot be picked anyway and are skipped."""
    vocab = logits.shape[1]
    pairs = [
        (row, token_id)
        for row, r in enumerate(rows)
        for token_id in r.banned_token_ids
        if 0 <= token_id < vocab
    ]
    if not pairs:
        return logits
    index = to_device(pairs, torch.long, logits.device).T  # [2, P]
    return logits.index_put((index[0], index[1]), logits.new_full((), float("-inf")))


def token_bitmask(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[ceil(V / 32)] int32 host bitmask allowing exactly `token_ids` (the grammar's
    layout: bit t % 32 of word t // 32 is token t)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
    np.bitwise_or.at(words, ids // 32, np.left_shift(1, ids % 32).astype(np.uint32))
    return torch.from_numpy(words.view(np.int32))


def leaves_no_token(
    allowed_tokens: torch.Tensor | None, banned_token_ids: Sequence[int], vocab_size: int
) -> bool:
    """Whether a row's constraints exclude every token: its `allowed_tokens` bitmask (None:
    any token) less its `banned_token_ids`. Every logit would be -inf and the argmax id 0, a
    token the row did not allow. Host work only (microseconds for 152k tokens)."""
    if allowed_tokens is None:
        return len(banned_token_ids) >= vocab_size and len(set(banned_token_ids)) >= vocab_size
    words = allowed_tokens.numpy()[: (vocab_size + 31) // 32].view(np.uint32).copy()
    if vocab_size % 32:  # bits past the vocabulary are no tokens
        words[-1] &= np.uint32((1 << (vocab_size % 32)) - 1)
    if len(banned_token_ids):
        ids = np.asarray(banned_token_ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        clear = np.invert(np.left_shift(1, ids % 32).astype(np.uint32))
        np.bitwise_and.at(words, ids // 32, clear)
    return not words.any()


def apply_allowed_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Rows with an `allowed_tokens` bitmask keep only those tokens; [S, V] -> [S, V] (a new
    tensor when any row has one)."""
    constrained = [index for index, row in enumerate(rows) if row.allowed_tokens is not None]
    if not constrained:
        return logits
    device, vocab = logits.device, logits.shape[1]
    words = torch.stack([rows[index].allowed_tokens for index in constrained])  # [R, W] int32
    # Little-endian: token t is bit t % 8 of byte t // 8 of the words' bytes. One lookup
    # per byte gives its 8 tokens' biases: 7x faster on a CPU than shifting bits out.
    packed = to_device(words.view(torch.uint8).flatten(), torch.uint8, device)  # [R * 4W]
    biases = _bit_biases(device, logits.dtype).index_select(0, packed.int())  # [R * 4W, 8]
    biases = biases.view(len(constrained), -1)[:, :vocab]  # [R, V]: 0 allowed, -inf not
    if len(constrained) == len(rows):
        return logits + biases
    return logits.index_add(0, to_device(constrained, torch.long, device), biases)


@functools.cache
def _bit_biases(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: entry [v, b] is 0 where bit b of byte value v is set, else -inf."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1  # [256, 8]
    return torch.where(bits == 1, 0.0, float("-inf")).to(device=device, dtype=dtype)


def apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k and top-p nucleus; [S, V] -> [S, V]."""
    if not any(p.top_k > 0 for p in params) and not any(p.top_p < 1.0 for p in params):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    remove = mask_sorted_top_k_top_p(sorted_logits, params).isneginf()
    mask = torch.zeros_like(remove).scatter(1, order, remove)
    return logits.masked_fill(mask, float("-inf"))


def mask_sorted_top_k_top_p(
    sorted_logits: torch.Tensor, params: list[SamplingParams]
) -> torch.Tensor:
    """Rows sorted best first ([S, N]: the vocabulary, or a top-N of it): tokens below
    each row's k-th logit (those tied with it stay), then tokens past its top_p nucleus of
    what is left, become -inf; the best token always stays."""
    num_rows, width = sorted_logits.shape
    device = sorted_logits.device
    remove = sorted_logits.isneginf()  # masked before (bans, a grammar) stay masked
    if any(p.top_k > 0 for p in params):
        kth = [min(p.top_k, width) - 1 if p.top_k > 0 else width - 1 for p in params]
        kth_logit = sorted_logits.gather(1, to_device(kth, torch.long, device).unsqueeze(1))
        remove |= sorted_logits < kth_logit
    if any(p.top_p < 1.0 for p in params):
        top_p = to_device([p.top_p for p in params], sorted_logits.dtype, device)
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [S, N] mass of better tokens
        remove |= mass_before >= top_p.unsqueeze(1)
    remove[:, 0] = False  # always keep the best token
    return sorted_logits.masked_fill(remove, float("-inf"))
