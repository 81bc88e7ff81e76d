"""The Qwen2.5-VL vision tower: Qwen2-VL's patch embedding, 2D rotary and attention, with
RMSNorm blocks, a gated silu MLP and window attention.

Window attention. Most blocks attend within windows of `window_size` pixels square
(112 = 4 x 4 merged tokens of 28 x 28 pixels); the blocks of `fullatt_block_indexes`
attend within whole frames, as in Qwen2-VL. The tower reorders its rows once, after the
patch embedding, so that every window is a run of consecutive rows, and puts the merged
tokens back in processor order at the end. Windows tile each frame row-major from its
top-left corner; those on the right and bottom edges may be smaller:

    one frame, 6 x 5 merged tokens, windows of 4 x 4:      rows in window order
    +-------------+-------+                                window 0: 16 tokens
    |  0  1  2  3 |  4  5 |                                window 1:  8 tokens
    |  6  7  8  9 | 10 11 |    -> 0 1 2 3 6 7 8 9 12 ..    window 2:  4 tokens
    | 12 13 14 15 | 16 17 |       4 5 10 11 16 17 22 23    window 3:  2 tokens
    | 18 19 20 21 | 22 23 |       24 25 26 27
    +-------------+-------+       28 29
    | 24 25 26 27 | 28 29 |
    +-------------+-------+

Each merged token is `merge**2` consecutive patch rows (the processor's merge order), so
the permutation moves blocks of `merge**2` rows and the merger still folds neighbours.
Frames stay in place (windows never cross a frame), so the whole-frame segments of the
full-attention blocks are the same row ranges before and after the reordering.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.device_io import to_device
from engine.model_config import VisionConfig
from engine.models.layers import ACTIVATIONS, RMSNorm, SiluAndMul
from engine.models.qwen2_vl_vision import (
    PatchMerger,
    VisionBlock,
    VisionRotary,
    embed_patches,
    frame_lengths,
    plan_vision_attention,
)


def window_order(
    grid_thw: Sequence[tuple[int, int, int]], merge: int, window_tokens: int
) -> tuple[torch.Tensor, list[int]]:
    """(order [num_merged_tokens] int64, window lengths in patch rows).

    `order[i]` is the processor-order index of the merged token that goes to place i when
    every frame's tokens are laid out window by window (row-major windows of
    `window_tokens` x `window_tokens` merged tokens, row-major inside each window)."""
    orders: list[torch.Tensor] = []
    lengths: list[int] = []
    start = 0
    for t, h, w in grid_thw:
        rows, cols = h // merge, w // merge
        y = torch.arange(rows).view(rows, 1).expand(rows, cols).reshape(-1)
        x = torch.arange(cols).view(1, cols).expand(rows, cols).reshape(-1)
        windows_across = -(-cols // window_tokens)
        window = (y // window_tokens) * windows_across + x // window_tokens
        inside = (y % window_tokens) * window_tokens + x % window_tokens
        frame_order = torch.argsort(window * window_tokens**2 + inside)  # keys are distinct
        window_sizes = torch.bincount(window).tolist()
        for _ in range(t):
            orders.append(frame_order + start)
            lengths += [size * merge**2 for size in window_sizes]
            start += rows * cols
    return torch.cat(orders), lengths


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up as one projection; with biases."""

    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden_dim, bias=True)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=True)
        self.act = act
        self.silu_and_mul = SiluAndMul()  # the fused kernel on CUDA

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, dim] -> [N, dim]
        gate_up = self.gate_up_proj(x)  # [N, 2 * hidden]
        if self.act == "silu":
            return self.down_proj(self.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(ACTIVATIONS[self.act](gate) * up)


class Qwen25VisionTransformer(nn.Module):
    """Encodes concatenated patch rows of several items in one call (as Qwen2-VL's tower)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        merged_pixels = config.spatial_merge_size * config.patch_size
        if config.window_size < merged_pixels or config.window_size % merged_pixels:
            raise ValueError(
                f"window_size {config.window_size} is not a positive multiple of "
                f"spatial_merge_size x patch_size = {merged_pixels}"
            )
        self.config = config
        self.window_tokens = config.window_size // merged_pixels
        self.full_attention_blocks = frozenset(config.fullatt_block_indexes)
        self.patch_embed = nn.Linear(config.patch_dim, config.embed_dim, bias=False)
        self.rotary = VisionRotary(config.embed_dim // config.num_heads)
        self.blocks = nn.ModuleList(
            VisionBlock(config, RMSNorm, GatedMLP(config.embed_dim, config.intermediate_size,
                                                  config.hidden_act))
            for _ in range(config.depth)
        )  # fmt: skip
        self.merger = PatchMerger(config, RMSNorm(config.embed_dim, eps=1e-6))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        # pixel_values [N, C * T_patch * P * P]; grid_thw [num_items, 3] -> [N / merge**2, out]
        grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        x, cos, sin = embed_patches(self, pixel_values, grids)
        unit = self.config.spatial_merge_size**2
        order, window_lengths = window_order(grids, self.config.spatial_merge_size,
                                             self.window_tokens)  # fmt: skip
        rows = (order.unsqueeze(1) * unit + torch.arange(unit)).reshape(-1)  # [N]
        rows = to_device(rows, torch.long, x.device)
        x, cos, sin = x[rows], cos[rows], sin[rows]  # window order
        full = plan_vision_attention(frame_lengths(grids), x.device, x.dtype)
        windowed = plan_vision_attention(window_lengths, x.device, x.dtype)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if index in self.full_attention_blocks else windowed)
        merged = self.merger(x)  # [N / unit, out], window order
        out = torch.empty_like(merged)
        out[to_device(order, torch.long, x.device)] = merged  # back to processor order
        return out
