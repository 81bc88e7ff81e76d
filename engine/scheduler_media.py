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
    (without `split_media`, unless the span starts the chunk), and before the first new
    item that the step's encoder budget or the cache's room cannot take."""
    if not split_media:
        for media in request.media:
            if media.offset < end < media.end and media.offset > start:
                end = media.offset  # stop before the span rather than split it
                break
    num_new_encoder_tokens = 0
    overlapping = request.media_overlapping(start, end)
    # Cached entries this chunk reads are acquired before any eviction: not room.
    hits = {m.content_hash for m in overlapping if cache.has(m.content_hash)}
    new_hashes: set[str] = set()
    for media in overlapping:
        if media.content_hash in hits or media.content_hash in to_encode:
            continue
        if media.content_hash in new_hashes:  # the same image twice in one chunk
            continue
        new_hashes.add(media.content_hash)
        num_new_encoder_tokens += media.num_tokens
        fits = num_new_encoder_tokens <= encoder_budget and cache.can_allocate(
            num_new_encoder_tokens, keep=hits
        )
        if not fits:
            end = max(media.offset, start)
            break
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
