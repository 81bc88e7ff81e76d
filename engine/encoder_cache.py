"""Encoder outputs by content hash: accounting (`EncoderCacheManager`) apart from storage.

Why a cache: a prefill chunk may end inside an image's placeholder span. The
image is encoded once, when the first chunk touching it is scheduled, and every
chunk then takes its slice of rows:

    prompt   | text | image (256 placeholders)          | text |
    chunks   |  chunk 1 (encodes image, rows 0:90)  | chunk 2 (rows 90:256) ...

`EncoderCacheManager` (pure Python, used by the scheduler) decides what is held:
a token budget; each entry is referenced by the requests that still need it; an
entry with no references sits in an LRU list and is evicted only to make room.
An entry a running request still needs is never evicted; one that a waiting request
needs and nothing else can serve (`MediaItem.cached_only`: a uuid-only part) is evicted
last. Evicted hashes are handed to the model runner, which drops them from the
`EncoderCache` tensor store; an entry whose rows never came (a failed encode) is
forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

import torch


class EncoderCacheManager:
    """Token-budgeted accounting of encoder outputs, referenced by request id."""

    def __init__(self, budget_tokens: int) -> None:
        self.budget_tokens = budget_tokens
        self.num_used_tokens = 0
        self._num_tokens: dict[str, int] = {}  # content hash -> rows
        self._refs: dict[str, set[str]] = {}  # content hash -> request ids needing it
        self._unreferenced: OrderedDict[str, None] = OrderedDict()  # LRU, oldest first
        self._evicted: list[str] = []

    def has(self, content_hash: str) -> bool:
        return content_hash in self._num_tokens

    @property
    def usage(self) -> float:
        """The fraction of the budget that entries hold, those kept only for reuse included
        (they are evicted only to make room)."""
        return self.num_used_tokens / self.budget_tokens if self.budget_tokens else 0.0

    def can_allocate(self, num_tokens: int, keep: Collection[str] = ()) -> bool:
        """Whether `num_tokens` new rows fit, evicting unreferenced entries not in `keep`."""
        evictable = sum(self._num_tokens[h] for h in self._unreferenced if h not in keep)
        return self.budget_tokens - self.num_used_tokens + evictable >= num_tokens

    def allocate(
        self, content_hash: str, num_tokens: int, request_id: str, *, spare: Collection[str] = ()
    ) -> None:
        """Accounts a new entry (the runner fills it this step), referenced by `request_id`.
        Unreferenced entries make room oldest first, those in `spare` only when no other
        is left."""
        if self.has(content_hash):
            self.acquire(content_hash, request_id)
            return
        while self.num_used_tokens + num_tokens > self.budget_tokens and self._unreferenced:
            victim = next((h for h in self._unreferenced if h not in spare), None)
            if victim is None:
                victim = next(iter(self._unreferenced))
            del self._unreferenced[victim]
            self.num_used_tokens -= self._num_tokens.pop(victim)
            del self._refs[victim]
            self._evicted.append(victim)
        self._num_tokens[content_hash] = num_tokens
        self._refs[content_hash] = {request_id}
        self.num_used_tokens += num_tokens

    def acquire(self, content_hash: str, request_id: str) -> None:
        self._refs[content_hash].add(request_id)
        self._unreferenced.pop(content_hash, None)

    def release(self, content_hash: str, request_id: str) -> None:
        refs = self._refs.get(content_hash)
        if refs is None or request_id not in refs:
            return
        refs.discard(request_id)
        if not refs:
            self._unreferenced[content_hash] = None

    def forget(self, content_hashes: Collection[str]) -> None:
        """Drops entries whose rows never reached the tensor store (their encode failed,
        or their step did), references and all: a later request must encode its item again
        rather than find an entry with nothing behind it."""
        for content_hash in content_hashes:
            if (num_tokens := self._num_tokens.pop(content_hash, None)) is not None:
                self.num_used_tokens -= num_tokens
                del self._refs[content_hash]
                self._unreferenced.pop(content_hash, None)

    def is_referenced_by(self, content_hash: str, request_id: str) -> bool:
        return request_id in self._refs.get(content_hash, ())

    def pop_evicted(self) -> list[str]:
        evicted, self._evicted = self._evicted, []
        return evicted


class EncoderCache:
    """The tensor store: content hash -> encoder output rows [num_tokens, hidden] on device."""

    def __init__(self) -> None:
        self._rows: dict[str, torch.Tensor] = {}

    def put(self, content_hash: str, rows: torch.Tensor) -> None:
        self._rows[content_hash] = rows

    def get(self, content_hash: str) -> torch.Tensor:
        return self._rows[content_hash]

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._rows

    def drop(self, content_hashes: list[str]) -> None:
        for content_hash in content_hashes:
            self._rows.pop(content_hash, None)


def salted(key: str, salt: str | None) -> str:
    """An encoder-cache key that only requests of the same `cache_salt` share: a tenant
    must neither reach another's media by its uuid nor time a cache hit on it. Unsalted
    keys (a content hash, "uuid:...") never start with "salt"; the length keeps one salt
    from ending where another's key begins."""
    return key if salt is None else f"salt{len(salt)}:{salt}|{key}"


def uuid_of(key: str) -> str | None:
    """The client's uuid an encoder-cache key was made of (engine/request_checks.py
    `_cache_key`: "uuid:" + it + "@image:1x4x4", a video's temporal patch + "/t0", maybe
    `salted`), None for a content hash's key."""
    if key.startswith("salt"):
        length, _, rest = key.removeprefix("salt").partition(":")
        key = rest[int(length) + 1 :]
    return key.removeprefix("uuid:").rsplit("@", 1)[0] if key.startswith("uuid:") else None
