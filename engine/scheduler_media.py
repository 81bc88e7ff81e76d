"""The scheduler's media rules over the encoder-cache accounts (`EncoderCacheManager`):
where a chunk must stop for its media, and which references a request holds (the rules
are in engine/scheduler.py's docstring, "Encoder references")."""

from __future__ import annotations

from engine.encoder_cache import EncoderCacheManager
from engine.request import MediaItem, Request


def cached_only_hashes(request: Request) -> set[str]:
    """The entries only the cache can serve to `request` (none of its items carries
    their pixels or features)."""
    if not any(m.cached_only for m in request.media):
        return set()
    served = {m.content_hash for m in request.media if not m.cached_only}
    return {m.content_hash for m in request.media if m.cached_only} - served


def chunk_end_for_media(
    request: Request,
    start: int,
    end: int,
    cache: EncoderCacheManager,
    to_encode: dict[str, MediaItem],
    encoder_budget: int,
    *,
    split_media: bool,
) -> int:
    """Where a chunk [start, end) must end for its media: before a span it would split
    (without `split_media`, unless the span starts the chunk), and before the first item
    that would not fit: a new one the step's encoder budget or the cache's room cannot take
    beside the cached entries read before it, or a cached one that the new items before it
    would need evicted (it is read, and encoded again if need be, by a later chunk).

    Items are taken in prompt order. Every cached entry anywhere in the chunk used to be
    kept from the start, and a new item before a cached one that did not fit beside it
    ended the chunk before that new item, at its start: a request with the items
    [big, small, big] under a cache of one big and a bit planned 0 tokens every step for
    ever, and at the head of the queue stalled every request behind it (fuzz46)."""
    if not split_media:
        for media in request.media:
            if media.offset < end < media.end and media.offset > start:
                end = media.offset  # stop before the span rather than split it
                break
    num_new_encoder_tokens = 0
    # Cached entries the chunk reads, acquired before any eviction, and those only the
    # cache can serve the request (held from its first chunk: Scheduler._commit_media).
    kept = {h for h in cached_only_hashes(request) if cache.has(h)}
    new_hashes: set[str] = set()
    for media in request.media_overlapping(start, end):
        content_hash = media.content_hash
        if content_hash in kept or content_hash in new_hashes or content_hash in to_encode:
            continue  # the same image twice in one chunk, or encoded this step already
        if cache.has(content_hash):
            fits = not num_new_encoder_tokens or cache.can_allocate(
                num_new_encoder_tokens, keep=kept | {content_hash}
            )
            kept.add(content_hash)
        else:
            new_hashes.add(content_hash)
            num_new_encoder_tokens += media.num_tokens
            fits = num_new_encoder_tokens <= encoder_budget and cache.can_allocate(
                num_new_encoder_tokens, keep=kept
            )
        if not fits:
            return max(media.offset, start)
    return end


def release_media(cache: EncoderCacheManager, request: Request, *, everything: bool) -> None:
    """Drops encoder references a request no longer needs (spans already in its KV;
    `everything`: preempted or finished). A running request keeps its cached-only
    items: a preemption would need them again, and nothing else can serve them."""
    # The same image twice: its hash stays referenced while a later span of it is
    # part-way done (only part-way spans, and a running request's cached-only items,
    # hold references: no request can wait on room that it holds itself).
    computed = request.num_computed_tokens
    still_needed = set()
    if not everything:
        still_needed = cached_only_hashes(request)
        still_needed |= {m.content_hash for m in request.media if m.offset < computed < m.end}
    for media in request.media:
        if media.content_hash not in still_needed and (everything or media.end <= computed):
            cache.release(media.content_hash, request.request_id)
