"""Multimodal rotary (M-RoPE) positions for Qwen2-VL prompts, as `transformers` computes them.

Every token gets three position ids (t, h, w). Text tokens get the same running
index in all three rows. A media span of grid (t, h, w) with merge size m lays
its `t * (h/m) * (w/m)` tokens out on a grid starting at the running index p:

    row t: p + frame          row h: p + y          row w: p + x

after which the running index advances by max(h, w) / m (as transformers 5 does).
So later tokens sit at `index + rope_delta` with `rope_delta = max(position) + 1 - len`
(<= 0), and decode token i (i >= prompt length) is at `i + rope_delta` in all rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.errors import MediaError

MediaSpan = tuple[int, int, tuple[int, int, int], str]  # (offset, num_tokens, grid_thw, modality)


def mrope_positions(
    token_ids: Sequence[int], media: Sequence[MediaSpan], *, spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """Returns (positions [3, len(token_ids)] int64, rope_delta) for one prompt.

    `media` lists each placeholder span in prompt order. Raises `MediaError` when a
    span is out of order, out of range, or its token count does not match its grid.
    """
    num_tokens_total = len(token_ids)
    pieces: list[torch.Tensor] = []  # each [3, n]
    cursor = 0  # next prompt index not yet placed
    next_pos = 0  # running position index
    merge = spatial_merge_size
    for offset, num_tokens, grid_thw, modality in media:
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
        pieces.append(_grid_positions(t, h // merge, w // merge, next_pos))
        next_pos += max(h, w) // merge
        cursor = offset + num_tokens
    if cursor < num_tokens_total:
        pieces.append(torch.arange(next_pos, next_pos + num_tokens_total - cursor).expand(3, -1))
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long), 0
    positions = torch.cat(pieces, dim=1).to(torch.long)  # [3, len]
    rope_delta = int(positions.max()) + 1 - num_tokens_total
    return positions, rope_delta


def decode_positions(start: int, count: int, rope_delta: int) -> torch.Tensor:
    """[3, count] int64 positions of sequence indices start .. start+count-1 after the prompt."""
    return torch.arange(start + rope_delta, start + rope_delta + count).expand(3, -1).contiguous()


def _grid_positions(t: int, h: int, w: int, start: int) -> torch.Tensor:  # [3, t*h*w]
    tt = torch.arange(t).view(t, 1, 1).expand(t, h, w)
    hh = torch.arange(h).view(1, h, 1).expand(t, h, w)
    ww = torch.arange(w).view(1, 1, w).expand(t, h, w)
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start
