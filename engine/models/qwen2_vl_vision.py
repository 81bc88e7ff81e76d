"""The Qwen2-VL vision tower: patch embedding, ViT blocks with 2D rotary, patch merger.

All items (images and videos) of one call are concatenated row-wise, no padding.
Attention is block-diagonal: every frame (`h * w` patches) attends only within
itself, exactly like the reference. Frames of equal length are attended in one
batched SDPA call, so a call costs one SDPA per distinct frame size. On CUDA in
float16 / bfloat16, frames of several sizes go through one variable-length flash
attention call instead (`torch.nn.attention.varlen`, frame boundaries as cu_seqlens).

Patch rows arrive in the order the Qwen2-VL image processor writes them:
per frame, `merge x merge` blocks of neighbouring patches are consecutive, so
the merger can fold 4 (for merge 2) consecutive rows into one output token.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.device_io import to_device
from engine.model_config import VisionConfig
from engine.models.layers import ACTIVATIONS, rope_inv_freq, rotary_tables, use_triton
from kernels.reference import rotary_folded

VISION_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class FrameGroup:
    """Frames of one length `length`; `rows` [num_frames, length] indexes the patch rows
    (None when the group covers all rows in order, so a plain view suffices)."""

    length: int
    rows: torch.Tensor | None


def plan_frame_groups(
    grid_thw: Sequence[tuple[int, int, int]], device: torch.device
) -> list[FrameGroup]:
    """Groups the frames of all items by length, for batched block-diagonal attention."""
    starts_by_length: dict[int, list[int]] = {}
    start = 0
    for t, h, w in grid_thw:
        for _ in range(t):
            starts_by_length.setdefault(h * w, []).append(start)
            start += h * w
    if len(starts_by_length) == 1:
        (length,) = starts_by_length
        return [FrameGroup(length, None)]
    groups = []
    for length, starts in starts_by_length.items():
        starts_tensor = torch.tensor(starts, dtype=torch.long).unsqueeze(1)  # [F, 1]
        rows = to_device(starts_tensor + torch.arange(length), torch.long, device)  # [F, L]
        groups.append(FrameGroup(length, rows))
    return groups


@dataclass(frozen=True)
class VisionAttentionPlan:
    """How one call's frames attend: `groups` for batched SDPA, or, when set, one varlen
    kernel call over frame boundaries `cu_seqlens` [num_frames + 1] int32 (device), and then
    no groups."""

    groups: list[FrameGroup]
    cu_seqlens: torch.Tensor | None = None
    max_frame_len: int = 0


def plan_vision_attention(
    grid_thw: Sequence[tuple[int, int, int]], device: torch.device, dtype: torch.dtype
) -> VisionAttentionPlan:
    frame_lens = [h * w for t, h, w in grid_thw for _ in range(t)]
    if len(set(frame_lens)) <= 1 or not _can_use_varlen(device, dtype):
        return VisionAttentionPlan(plan_frame_groups(grid_thw, device))
    cu_seqlens = to_device([0, *itertools.accumulate(frame_lens)], torch.int32, device)
    return VisionAttentionPlan([], cu_seqlens, max(frame_lens))


def _can_use_varlen(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and importlib.util.find_spec("torch.nn.attention.varlen") is not None
    )


def vision_rotary_positions(
    grid_thw: Sequence[tuple[int, int, int]], merge: int
) -> torch.Tensor:  # [N, 2] int64 (h, w) per patch row, in processor order
    positions = []
    for t, h, w in grid_thw:
        hpos = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        wpos = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # block-major order: (h_block, w_block, h_in, w_in)
        hpos = hpos.permute(0, 2, 1, 3).reshape(-1)
        wpos = wpos.permute(0, 2, 1, 3).reshape(-1)
        positions.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    return torch.cat(positions, dim=0)


class VisionRotary(nn.Module):
    """2D rotary: a quarter of the head dim rotates with h, a quarter with w (then mirrored)."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", torch.empty(head_dim // 4), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        self.inv_freq = rope_inv_freq(self.head_dim // 2, VISION_ROPE_THETA, self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [N, 2] -> cos, signed sin [N, 1, head_dim] float32 (`rotary_tables`)
        freqs = positions.unsqueeze(-1).float() * self.inv_freq  # [N, 2, D/4]
        freqs = freqs.flatten(1)  # [N, D/2] (h freqs then w freqs)
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        return rotary_tables(emb.cos(), emb.sin())


def rotate_qk(
    qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of a QKV projection [N, 3, H, D], rotated in float32 and rounded once to the
    model dtype, as the reference rotates `q.float()`; tables [N, 1, D] float32
    (`rotary_tables`: roll with a signed sin equals rotate_half with sin exactly).

    q and k rotate together: one pass per layer, not two (the tower is launch-bound on a GPU
    at one image per call). On CUDA one Triton kernel rotates them in place in the QKV
    buffer (q and k come back as views of it); the torch path casts, rotates and casts
    back in six kernels with three times the memory traffic."""
    num_rows, _, num_heads, head_dim = qkv.shape
    if use_triton(qkv):
        from kernels.triton.rotary import rotary_folded_

        rotary_folded_(qkv.view(num_rows, 3 * num_heads, head_dim)[:, : 2 * num_heads],
                       cos, signed_sin)  # fmt: skip
        return qkv[:, 0], qkv[:, 1]
    qk = qkv[:, :2].transpose(0, 1)  # [2, N, H, D]
    q, k = rotary_folded(qk.float(), cos, signed_sin).to(qkv.dtype).unbind(0)
    return q, k


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: VisionAttentionPlan
    ) -> torch.Tensor:  # x [N, dim] -> [N, dim]
        num_rows = x.shape[0]
        qkv = self.qkv(x).view(num_rows, 3, self.num_heads, self.head_dim)
        q, k = rotate_qk(qkv, cos, sin)  # [N, H, D] each
        v = qkv[:, 2]  # [N, H, D]
        groups = plan.groups
        if plan.cu_seqlens is not None:
            from torch.nn.attention.varlen import varlen_attn

            cu, longest = plan.cu_seqlens, plan.max_frame_len
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            out = varlen_attn(q, k, v, cu, cu, longest, longest)  # [N, H, D]
            out = out.reshape(num_rows, -1)
        elif len(groups) == 1 and groups[0].rows is None:
            out = self._attend(q, k, v, groups[0].length).reshape(num_rows, -1)
        else:
            out = torch.empty_like(q)  # [N, H, D]
            for group in groups:
                rows = group.rows.reshape(-1)
                out[rows] = self._attend(q[rows], k[rows], v[rows], group.length)
            out = out.reshape(num_rows, -1)
        return self.proj(out)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int
    ) -> torch.Tensor:  # [F * L, H, D] -> [F * L, H, D], attention within each frame
        def frames(t: torch.Tensor) -> torch.Tensor:
            return t.view(-1, length, self.num_heads, self.head_dim).transpose(1, 2)  # [F, H, L, D]

        out = F.scaled_dot_product_attention(frames(q), frames(k), frames(v))  # [F, H, L, D]
        return out.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = ACTIVATIONS[act]
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, act: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.attn = VisionAttention(config.embed_dim, config.num_heads)
        self.norm2 = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.mlp = VisionMLP(config.embed_dim, int(config.embed_dim * config.mlp_ratio), act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: VisionAttentionPlan
    ) -> torch.Tensor:  # [N, embed] -> [N, embed]
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm, fold `merge**2` neighbouring rows into one, 2-layer GELU MLP to the LLM width."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.merged_dim = config.embed_dim * config.spatial_merge_size**2
        self.ln_q = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.fc2 = nn.Linear(self.merged_dim, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, embed] -> [N / merge**2, out]
        x = self.ln_q(x).view(-1, self.merged_dim)
        return self.fc2(F.gelu(self.fc1(x)))


class Qwen2VisionTransformer(nn.Module):
    """Encodes concatenated patch rows of several items in one call."""

    def __init__(self, config: VisionConfig, act: str = "quick_gelu") -> None:
        super().__init__()
        self.config = config
        # The reference's Conv3d has kernel == stride == the whole patch: a plain matmul.
        self.patch_embed = nn.Linear(config.patch_dim, config.embed_dim, bias=False)
        self.rotary = VisionRotary(config.embed_dim // config.num_heads)
        self.blocks = nn.ModuleList([VisionBlock(config, act) for _ in range(config.depth)])
        self.merger = PatchMerger(config)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        # pixel_values [N, C * T_patch * P * P]; grid_thw [num_items, 3] -> [N / merge**2, out]
        grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        # The merger's LayerNorm is never prepacked (see engine/models/cpu_prepack.py).
        device, dtype = self.merger.ln_q.weight.device, self.merger.ln_q.weight.dtype
        x = self.patch_embed(pixel_values.to(device=device, dtype=dtype))
        merge = self.config.spatial_merge_size
        positions = to_device(vision_rotary_positions(grids, merge), torch.long, device)
        cos, sin = self.rotary(positions)  # [N, 1, D] each, float32 (sin signed)
        plan = plan_vision_attention(grids, device, dtype)
        for block in self.blocks:
            x = block(x, cos, sin, plan)
        return self.merger(x)
