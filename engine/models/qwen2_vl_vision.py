"""The Qwen2-VL vision tower: patch embedding, ViT blocks with 2D rotary, patch merger.
Its attention and rotary serve the Qwen2.5-VL tower too (qwen2_5_vl_vision.py).

All items (images and videos) of one call are concatenated row-wise, no padding.
Attention is block-diagonal over segments: in Qwen2-VL every frame (`h * w` patches)
attends only within itself, exactly like the reference. Segments of equal length are
attended in one batched SDPA call, so a call costs one SDPA per distinct segment length.
On CUDA in float16 / bfloat16, segments of several lengths go through one variable-length
flash attention call instead (`torch.nn.attention.varlen`, boundaries as cu_seqlens).

Patch rows arrive in the order the Qwen2-VL image processor writes them:
per frame, `merge x merge` blocks of neighbouring patches are consecutive, so
the merger can fold 4 (for merge 2) consecutive rows into one output token.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable, Sequence
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
class SegmentGroup:
    """Attention segments (frames, or windows of frames) of one length `length`; `rows`
    [num_segments, length] indexes their rows (None when the group covers all rows in
    order, so a plain view suffices)."""

    length: int
    rows: torch.Tensor | None


def frame_lengths(grid_thw: Sequence[tuple[int, int, int]]) -> list[int]:
    """Rows of every frame of every item, in order: the segments of full attention."""
    return [h * w for t, h, w in grid_thw for _ in range(t)]


def plan_segment_groups(lengths: Sequence[int], device: torch.device) -> list[SegmentGroup]:
    """Groups consecutive segments of `lengths` rows by length, for batched
    block-diagonal attention."""
    starts_by_length: dict[int, list[int]] = {}
    start = 0
    for length in lengths:
        starts_by_length.setdefault(length, []).append(start)
        start += length
    if len(starts_by_length) == 1:
        (length,) = starts_by_length
        return [SegmentGroup(length, None)]
    groups = []
    for length, starts in starts_by_length.items():
        starts_tensor = torch.tensor(starts, dtype=torch.long).unsqueeze(1)  # [S, 1]
        rows = to_device(starts_tensor + torch.arange(length), torch.long, device)  # [S, L]
        groups.append(SegmentGroup(length, rows))
    return groups


@dataclass(frozen=True)
class VisionAttentionPlan:
    """How one call's segments attend: `groups` for batched SDPA, or, when set, one varlen
    kernel call over segment boundaries `cu_seqlens` [num_segments + 1] int32 (device), and
    then no groups."""

    groups: list[SegmentGroup]
    cu_seqlens: torch.Tensor | None = None
    max_segment_len: int = 0


def plan_vision_attention(
    lengths: Sequence[int], device: torch.device, dtype: torch.dtype
) -> VisionAttentionPlan:
    """Attention within each of the consecutive segments of `lengths` rows."""
    if len(set(lengths)) <= 1 or not _can_use_varlen(device, dtype):
        return VisionAttentionPlan(plan_segment_groups(lengths, device))
    cu_seqlens = to_device([0, *itertools.accumulate(lengths)], torch.int32, device)
    return VisionAttentionPlan([], cu_seqlens, max(lengths))


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

    def __init__(self, head_dim: int, theta: float = VISION_ROPE_THETA) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", torch.empty(head_dim // 4), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        self.inv_freq = rope_inv_freq(self.head_dim // 2, self.theta, self.inv_freq.device)

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

            cu, longest = plan.cu_seqlens, plan.max_segment_len
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
    ) -> torch.Tensor:  # [S * L, H, D] -> [S * L, H, D], attention within each segment
        def segments(t: torch.Tensor) -> torch.Tensor:
            return t.view(-1, length, self.num_heads, self.head_dim).transpose(1, 2)  # [S, H, L, D]

        out = F.scaled_dot_product_attention(segments(q), segments(k), segments(v))
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
    """Pre-norm ViT block. `norm` makes its two norms (LayerNorm in Qwen2-VL, RMSNorm in
    Qwen2.5-VL), `mlp` is its MLP (VisionMLP, or Qwen2.5-VL's gated one)."""

    def __init__(self, config: VisionConfig, norm: Callable[..., nn.Module], mlp: nn.Module):
        super().__init__()
        self.norm1 = norm(config.embed_dim, eps=1e-6)
        self.attn = VisionAttention(config.embed_dim, config.num_heads)
        self.norm2 = norm(config.embed_dim, eps=1e-6)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: VisionAttentionPlan
    ) -> torch.Tensor:  # [N, embed] -> [N, embed]
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm (`norm`: LayerNorm for Qwen2-VL, RMSNorm for Qwen2.5-VL), fold `merge**2`
    neighbouring rows into one, 2-layer GELU MLP to the LLM width."""

    def __init__(self, config: VisionConfig, norm: nn.Module) -> None:
        super().__init__()
        self.merged_dim = config.embed_dim * config.spatial_merge_size**2
        self.ln_q = norm
        self.fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.fc2 = nn.Linear(self.merged_dim, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, embed] -> [N / merge**2, out]
        x = self.ln_q(x).view(-1, self.merged_dim)
        return self.fc2(F.gelu(self.fc1(x)))


class Qwen2VisionTransformer(nn.Module):
    """Encodes concatenated patch rows of several items in one call."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        # The reference's Conv3d has kernel == stride == the whole patch: a plain matmul.
        self.patch_embed = nn.Linear(config.patch_dim, config.embed_dim, bias=False)
        self.rotary = VisionRotary(config.embed_dim // config.num_heads)
        self.blocks = nn.ModuleList(
            VisionBlock(config, nn.LayerNorm, VisionMLP(config.embed_dim, config.intermediate_size,
                                                        config.hidden_act))
            for _ in range(config.depth)
        )  # fmt: skip
        self.merger = PatchMerger(config, nn.LayerNorm(config.embed_dim, eps=1e-6))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        # pixel_values [N, C * T_patch * P * P]; grid_thw [num_items, 3] -> [N / merge**2, out]
        grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        x, cos, sin = embed_patches(self, pixel_values, grids)
        plan = plan_vision_attention(frame_lengths(grids), x.device, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, plan)
        return self.merger(x)


def embed_patches(
    tower: nn.Module, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The patch embeddings [N, embed] of a tower (on its device, in its dtype) and the
    rotary tables cos, signed sin [N, 1, head_dim] float32 of their rows, processor order."""
    # The merger's norm is never prepacked (see engine/models/cpu_prepack.py).
    device, dtype = tower.merger.ln_q.weight.device, tower.merger.ln_q.weight.dtype
    x = tower.patch_embed(pixel_values.to(device=device, dtype=dtype))
    merge = tower.config.spatial_merge_size
    positions = to_device(vision_rotary_positions(grids, merge), torch.long, device)
    cos, sin = tower.rotary(positions)
    return x, cos, sin
