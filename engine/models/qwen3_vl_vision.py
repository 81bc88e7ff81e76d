"""The Qwen3-VL vision tower: Qwen2-VL's blocks (LayerNorm, 2D rotary, attention within
whole frames) with a biased patch embedding, a learned position table and "deepstack".

* Positions: a square table of `num_position_embeddings` learned rows (side s) is resampled
  to each frame's h x w patch grid by bilinear interpolation with aligned corners, as
  `F.interpolate(..., align_corners=True)`: patch (r, c) mixes the 4 rows around
  (r (s-1) / (h-1), c (s-1) / (w-1)). The mix is added to the patch embeddings.
* Deepstack: the outputs of the blocks in `deepstack_visual_indexes` go through patch
  mergers of their own (which norm after folding the 2 x 2 rows, not before). The tower
  returns the final merger's rows and each level's side by side, [N / 4, out * (1 + k)]:
  the decoder adds level i at the media rows after its layer i (qwen2_vl.py).

Rows arrive in the processor's order (2 x 2 blocks of neighbouring patches consecutive),
like the other towers'.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.device_io import to_device
from engine.model_config import VisionConfig
from engine.models.layers import ACTIVATIONS
from engine.models.qwen2_vl_vision import (
    VisionBlock,
    VisionRotary,
    frame_lengths,
    plan_vision_attention,
    vision_rotary_positions,
)


class Qwen3VisionMLP(nn.Module):
    """Qwen2-VL's VisionMLP under the checkpoint's names (`linear_fc1`, `linear_fc2`)."""

    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden_dim)
        self.act = ACTIVATIONS[act]
        self.linear_fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3PatchMerger(nn.Module):
    """LayerNorm, fold 2 x 2 neighbouring rows into one, Linear-GELU-Linear to the decoder
    width. `after_fold` (the deepstack mergers) norms the folded rows instead."""

    def __init__(self, config: VisionConfig, *, after_fold: bool) -> None:
        super().__init__()
        self.merged_dim = config.embed_dim * config.spatial_merge_size**2
        self.after_fold = after_fold
        self.norm = nn.LayerNorm(self.merged_dim if after_fold else config.embed_dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.linear_fc2 = nn.Linear(self.merged_dim, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, embed] -> [N / 4, out]
        if self.after_fold:
            x = self.norm(x.view(-1, self.merged_dim))
        else:
            x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


@functools.lru_cache(maxsize=256)
def position_taps(h: int, w: int, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For one h x w frame, in the processor's row order: the 4 table rows each patch mixes
    [h * w, 4] int64 (top-left, top-right, bottom-left, bottom-right) and their bilinear
    weights [h * w, 4] float32 (aligned corners)."""

    def axis(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        source = torch.arange(length, dtype=torch.float32) * (side - 1) / max(length - 1, 1)
        low = source.floor()
        weight_high = source - low
        low = low.long()
        return low, (low + 1).clamp(max=side - 1), weight_high

    row_low, row_high, row_weight = axis(h)
    col_low, col_high, col_weight = axis(w)
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    rows = rows.permute(0, 2, 1, 3).reshape(-1)  # block-major, as the processor writes
    cols = cols.permute(0, 2, 1, 3).reshape(-1)
    top, bottom = row_low[rows] * side, row_high[rows] * side
    left, right = col_low[cols], col_high[cols]
    taps = torch.stack([top + left, top + right, bottom + left, bottom + right], dim=1)
    down, across = row_weight[rows], col_weight[cols]
    weights = torch.stack(
        [(1 - down) * (1 - across), (1 - down) * across, down * (1 - across), down * across],
        dim=1,
    )
    return taps, weights


class Qwen3VisionTransformer(nn.Module):
    """Encodes concatenated patch rows of several items in one call; returns the merged
    rows and the deepstack levels' side by side [N / 4, out * (1 + levels)]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        # The reference's Conv3d has kernel == stride == the whole patch: a matmul (+ bias).
        self.patch_embed = nn.Linear(config.patch_dim, config.embed_dim, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.embed_dim)
        self.side = int(config.num_position_embeddings**0.5)
        self.rotary = VisionRotary(config.embed_dim // config.num_heads, config.rope_theta)
        self.blocks = nn.ModuleList(
            VisionBlock(config, nn.LayerNorm, Qwen3VisionMLP(config.embed_dim,
                                                             config.intermediate_size,
                                                             config.hidden_act))
            for _ in range(config.depth)
        )  # fmt: skip
        self.merger = Qwen3PatchMerger(config, after_fold=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(config, after_fold=True) for _ in config.deepstack_visual_indexes
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        # The position table's weight gives device and dtype: on a CPU the linears may be
        # prepacked (engine/models/cpu_prepack.py) and have no `weight` any more.
        table = self.pos_embed.weight
        x = self.patch_embed(pixel_values.to(device=table.device, dtype=table.dtype))
        x = x + self._positions(grids).to(x.dtype)  # [N, embed]
        positions = vision_rotary_positions(grids, self.config.spatial_merge_size)
        cos, sin = self.rotary(to_device(positions, torch.long, x.device))
        plan = plan_vision_attention(frame_lengths(grids), x.device, x.dtype)
        levels = dict(zip(self.config.deepstack_visual_indexes, self.deepstack_merger_list,
                          strict=True))  # fmt: skip
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, plan)
            if index in levels:
                deepstack.append(levels[index](x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)

    def _positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:  # [N, embed]
        """The learned position table resampled to every frame's grid."""
        merge = self.config.spatial_merge_size
        taps, weights = zip(*(position_taps(h, w, self.side, merge) for t, h, w in grids
                              for _ in range(t)), strict=True)  # fmt: skip
        device = self.pos_embed.weight.device
        taps_all = to_device(torch.cat(taps), torch.long, device)  # [N, 4]
        weights_all = to_device(torch.cat(weights), torch.float32, device)  # [N, 4]
        table = self.pos_embed(taps_all)  # [N, 4, embed]
        return (table * weights_all.to(table.dtype).unsqueeze(-1)).sum(1)
