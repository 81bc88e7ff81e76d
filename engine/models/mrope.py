"""Multimodal rotary (M-RoPE) positions for Qwen2-VL prompts, as `transformers` computes them.

Every token gets three position ids (t, h, w). Text tokens get the same running
index in all three rows. A media span of grid (t, h, w) with merge size m lays
its `t * (h/m) * (w/m)` tokens out on a grid starting at the running index p:

    row t: p + frame          row h: p + y          row w: p + x

after which the running index advances by max(h, w) / m (as transformers 5 does).

Qwen2.5-VL spaces a video's temporal patches by time instead of by one: `frame` above
becomes floor(frame x tokens_per_second x second_per_grid_t), where second_per_grid_t is
the seconds of video one temporal patch spans (temporal_patch_size / the sampled fps),
computed in float32 as transformers does.

Decoding continues from the prompt's last position: decode token i (i >= prompt length) is
at `i + rope_delta` in all rows, `rope_delta = last position + 1 - len` (<= 0), as
transformers 5's `generate()` steps on from the last prompt token. This is not always
`max(position) + 1 - len`: a video whose temporal positions run past the text after it
(16 temporal patches, 4 x 4 merged tokens, a few words after) has its largest position
inside the video.

Where transformers 5 departs from Qwen's original rule: Qwen's reference code (and vLLM)
start the text after a media span at max(position) + 1, which for such a video is larger
than p + max(h, w) / m. For images, and videos no longer in time than in space, the two
rules agree. Tessera follows transformers (the project's oracle); docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.errors import MediaError

MediaSpan = tuple[int, int, tuple[int, int, int], str]  # (offset, num_tokens, grid_thw, modality)


def mrope_positions(
    token_ids: Sequence[int],
    media: Sequence[MediaSpan],
    *,
    spatial_merge_size: int,
    tokens_per_second: float | None = None,
    second_per_grid_ts: Sequence[float] | None = None,
) -> tuple[torch.Tensor, int]:
    """Returns (positions [3, len(token_ids)] int64, rope_delta) for one prompt.

    `media` lists each placeholder span in prompt order. With `tokens_per_second`
    (Qwen2.5-VL), video spans are spaced in time by `second_per_grid_ts` (one per span of
    `media`; 1.0 each when None). Raises `MediaError` when a span is out of order, out of
    range, or its token count does not match its grid.
    """
    num_tokens_total = len(token_ids)
    pieces: list[torch.Tensor] = []  # each [3, n]
    cursor = 0  # next prompt index not yet placed
    next_pos = 0  # running position index
    merge = spatial_merge_size
    seconds = second_per_grid_ts if second_per_grid_ts is not None else [1.0] * len(media)
    for (offset, num_tokens, grid_thw, modality), second in zip(media, seconds, strict=True):
        t, h, w = grid_thw
        if offset < cursor or offset + num_tokens > num_tokens_total:
            raise MediaError(f"{modality} placeholder span at {offset} is out of order or range")
        if h % merge or w % merge or t * (h // merge) * (w // merge) != num_tokens:
            raise MediaError(
                f"{modality} at {offset} has {num_tokens} placeholders, "
                f"which does not match grid_thw {tuple(grid_thw)}"
            )
        if offset > cursor:
            text_len = offset - cursor
            pieces.append(torch.arange(next_pos, next_pos + text_len).expand(3, -1))
            next_pos += text_len
        step = None
        if tokens_per_second is not None and modality == "video":
            step = torch.tensor(second, dtype=torch.float32) * tokens_per_second
        pieces.append(_grid_positions(t, h // merge, w // merge, next_pos, step))
        next_pos += max(h, w) // merge
        cursor = offset + num_tokens
    if cursor < num_tokens_total:
        pieces.append(torch.arange(next_pos, next_pos + num_tokens_total - cursor).expand(3, -1))
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long), 0
    positions = torch.cat(pieces, dim=1).to(torch.long)  # [3, len]
    # The last column: all three rows are equal there whenever the prompt ends in text (a
    # chat prompt always does); the largest of them otherwise.
    rope_delta = int(positions[:, -1].max()) + 1 - num_tokens_total
    return positions, rope_delta


def decode_positions(start: int, count: int, rope_delta: int) -> torch.Tensor:
    """[3, count] int64 positions of sequence indices start .. start+count-1 after the prompt."""
    return torch.arange(start + rope_delta, start + rope_delta + count).expand(3, -1).contiguous()


def _grid_positions(
    t: int, h: int, w: int, start: int, step: torch.Tensor | None = None
) -> torch.Tensor:  # [3, t*h*w]
    """Grid positions from `start`; temporal patch i at floor(i x `step`) (float32) when a
    step is given, else at i."""
    frames = torch.arange(t) if step is None else (torch.arange(t) * step).long()
    tt = frames.view(t, 1, 1).expand(t, h, w)
    hh = torch.arange(h).view(1, h, 1).expand(t, h, w)
    ww = torch.arange(w).view(1, 1, w).expand(t, h, w)
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start
