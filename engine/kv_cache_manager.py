"""Paged KV cache accounting: which blocks each request holds, and the prefix cache.

Pure Python, no tensors: the model runner owns the cache tensors and only reads
`request.block_ids`. A request's sequence index i lives in block
`request.block_ids[i // block_size]`, offset `i % block_size`:

    tokens   |0 1 2 3|4 5 6 7|8 9 . .|          block_size = 4
    blocks   [  17   ][   3   ][  42  ]          10 tokens -> 3 blocks
             full     full     partial

Prefix caching: once a block is full, it gets a content hash chained from the
previous block's hash, its token ids, and the content hashes (with offsets) of
media overlapping it, so equal text with different images never shares KV. A request's
`cache_salt` seeds the first hash: only requests with the same salt (or none) share
blocks, so one tenant cannot learn from timing what another one's prompts were.
Freed blocks keep their hash and sit in the free queue (LRU: reused from the
head, freed ones appended to the tail) until a new allocation evicts them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: engine.request imports torch, this module needs none
    from engine.request import Request


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once full and registered in the prefix cache


def _salt(cache_salt: str | None) -> bytes:
    """What the first block's hash chains from."""
    return b"" if cache_salt is None else b"salt:" + cache_salt.encode()


class KVCacheManager:
    """Allocates KV blocks to requests (all or nothing) and serves cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # ref_count == 0 blocks, eviction order first; value unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._newly_cached: list[int] = []  # since the last pop_newly_cached()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reads_cache_for(self, request: Request) -> bool:
        """Whether a new request's prompt is looked up in the cache: not with caching off,
        nor for one that scores its prompt (cached rows have no logits)."""
        return self.enable_prefix_caching and request.sampling.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached full blocks matching the start of a request with no KV yet.

        Returns (block ids, number of tokens they cover). The hit never covers the
        last token (it must be recomputed to get logits), nor a span that the limit
        (that token, or the prompt logprobs still to score) would split. It may end
        inside an earlier span, at a block boundary: the chunk that goes on from there
        takes that span's encoder rows from the encoder cache or encodes it again
        (scheduler_media.py), as a chunk split by --split-media does.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return [], 0
        max_tokens = request.num_tokens - 1
        if request.sampling.prompt_logprobs is not None:
            # Cached rows have no logits: score the prompt tokens not scored yet.
            max_tokens = min(max_tokens, len(request.prompt_logprobs))
        for media in request.media:  # cut back to the start of a span the hit would split
            if media.offset < max_tokens < media.end:
                max_tokens = media.offset
        self._update_hashes(request, request.num_tokens)
        max_blocks = max_tokens // self.block_size
        block_ids: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_block_ids: list[int] | None = None
    ) -> bool:
        """Makes room for `num_new_tokens` after the computed ones; False (and no change) if full.

        `computed_block_ids` (from `get_computed_blocks`, for a request holding no
        blocks) are taken first; their tokens count as computed.
        """
        if not computed_block_ids and self._fits_held_blocks(request, num_new_tokens):
            return True
        computed = computed_block_ids or []
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens)
        num_new_blocks = num_needed - len(request.block_ids) - len(computed)
        num_computed_free = sum(1 for b in computed if self.blocks[b].ref_count == 0)
        if max(num_new_blocks, 0) + num_computed_free > len(self._free):
            return False
        for block_id in computed:
            self._take(block_id, is_hit=True)
        request.block_ids.extend(computed)
        for _ in range(max(num_new_blocks, 0)):
            block_id = next(iter(self._free))
            self._take(block_id, is_hit=False)
            request.block_ids.append(block_id)
        if self.enable_prefix_caching:
            self._register_full_blocks(request, num_computed + num_new_tokens)
        return True

    def _fits_held_blocks(self, request: Request, num_new_tokens: int) -> bool:
        """The common decode step: the new tokens fit the blocks the request holds and fill
        no block that is not registered yet, so there is nothing to take or register."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        if num_tokens > len(request.block_ids) * self.block_size:
            return False
        return (
            not self.enable_prefix_caching
            or num_tokens // self.block_size <= request.num_registered_blocks
        )

    def free(self, request: Request, *, keep_cached: bool = True) -> None:
        """Returns a request's blocks. With `keep_cached=False` (its KV may be garbage,
        e.g. after a failed step) its blocks also leave the prefix cache."""
        for block_id in reversed(request.block_ids):  # tail blocks are evicted first
            block = self.blocks[block_id]
            if not keep_cached:
                self._uncache(block)
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        request.block_ids = []
        request.num_registered_blocks = 0

    def pop_newly_cached(self) -> list[int]:
        """Blocks entered into the prefix cache since the last call (one step's: their KV
        is written only when that step runs)."""
        blocks, self._newly_cached = self._newly_cached, []
        return blocks

    def uncache(self, block_ids: list[int]) -> None:
        """Takes blocks out of the prefix cache (a failed step never wrote their KV)."""
        for block_id in block_ids:
            self._uncache(self.blocks[block_id])

    def _take(self, block_id: int, *, is_hit: bool) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
            if not is_hit:
                self._uncache(block)  # reused for new content: evict its old hash
        block.ref_count += 1

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash = None

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Registers the blocks that are full once `num_tokens` tokens have KV.

        Only blocks past `request.num_registered_blocks` are looked at: every decode step
        allocates, and walking all of a long request's blocks each time cost O(context)
        per request per step."""
        num_full = num_tokens // self.block_size
        self._update_hashes(request, num_full * self.block_size)
        # A block ending in a token still in flight (overlap scheduling) has no hash yet;
        # the request's next allocation registers it.
        end = min(num_full, len(request.block_hashes))
        for index in range(request.num_registered_blocks, end):
            block = self.blocks[request.block_ids[index]]
            if block.block_hash is not None:  # a prefix-cache hit: cached already
                continue
            block_hash = request.block_hashes[index]
            if block_hash not in self._cached:  # a duplicate keeps the first copy cached
                self._cached[block_hash] = block.block_id
                block.block_hash = block_hash
                self._newly_cached.append(block.block_id)
        request.num_registered_blocks = max(request.num_registered_blocks, end)

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extends `request.block_hashes` over the full blocks of its first `num_tokens`."""
        size = self.block_size
        num_full = min(num_tokens, request.num_tokens) // size
        for index in range(len(request.block_hashes), num_full):
            start, end = index * size, (index + 1) * size
            previous = request.block_hashes[index - 1] if index else _salt(request.cache_salt)
            hasher = hashlib.sha256(previous)
            for token_id in request.token_ids_between(start, end):
                hasher.update(token_id.to_bytes(4, "little", signed=True))
            for media in request.media_overlapping(start, end):
                hasher.update(f"|{media.content_hash}@{media.offset}".encode())
                if media.second_per_grid_t is not None:  # moves the span's positions
                    hasher.update(f"/{media.second_per_grid_t!r}".encode())
            request.block_hashes.append(hasher.digest())
