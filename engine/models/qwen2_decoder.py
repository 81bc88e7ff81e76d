"""The Qwen2 text decoder with multimodal rotary embeddings (M-RoPE), over a paged KV cache.

Inputs are flat over all sequences of a step (no padding): `T` tokens in all.
Attention is delegated to an `AttentionBackend`, which writes this step's K/V
into the per-layer cache and attends over each sequence's history.

Projections are fused at load time: one `qkv_proj` (q, k, v weights and biases
concatenated along the output dim) and one `gate_up_proj` per layer.

Llama's decoder is this one without the q, k, v biases (`ModelConfig.attention_bias`) and,
for Llama 3.1 and later, with its rotary scaling (`ModelConfig.llama3_rope_scaling`).
Qwen3's is this one without the biases and with `q_norm` / `k_norm`, an RMSNorm over each
query and key head before the rotary embedding (`ModelConfig.qk_norm`); Qwen3-MoE's has
a mixture of experts (engine/models/moe.py) in place of the MLP in its sparse layers.

Under tensor parallelism (engine/tensor_parallel.py) the config holds this rank's share of
the heads and the MLP width, and `all_reduce` sums the partial outputs of o_proj and
down_proj over the ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.model_config import Llama3RopeScaling, ModelConfig
from engine.models.layers import (
    RMSNorm,
    SiluAndMul,
    llama3_inv_freq,
    rope_inv_freq,
    rotary_tables,
)
from engine.models.moe import SparseMoE

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums over the tensor-parallel ranks


class MRotaryEmbedding(nn.Module):
    """cos/sin for 3-row M-RoPE positions.

    The `head_dim // 2` frequencies are split into `mrope_section = (s_t, s_h, s_w)`
    consecutive groups; group j takes its angle from position row j (t, h or w).
    `interleaved` (Qwen3-VL) deals them out in turn instead: frequency 3i + 1 takes h for
    the first s_h, 3i + 2 takes w for the first s_w, all others t.
    For text tokens all three rows are equal, which reduces to ordinary RoPE.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        mrope_section: tuple[int, int, int],
        llama3_scaling: Llama3RopeScaling | None = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.llama3_scaling = llama3_scaling
        self.interleaved = interleaved
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim // 2")
        self.head_dim = head_dim
        self.theta = theta
        self.mrope_section = mrope_section
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.register_buffer(
            "section_rows", torch.empty(head_dim // 2, dtype=torch.long), persistent=False
        )
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the constant buffers; the loader calls this after materialising."""
        device = self.inv_freq.device
        inv_freq = rope_inv_freq(self.head_dim, self.theta, device=device)  # [D/2] fp32
        if self.llama3_scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, *dataclasses.astuple(self.llama3_scaling))
        self.inv_freq = inv_freq
        rows = [row for row, size in enumerate(self.mrope_section) for _ in range(size)]
        if self.interleaved:
            _, num_h, num_w = self.mrope_section
            rows = [0] * len(rows)
            rows[1 : 3 * num_h : 3] = [1] * num_h
            rows[2 : 3 * num_w : 3] = [2] * num_w
        self.section_rows = torch.tensor(rows, dtype=torch.long, device=device)  # [D/2]

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [3, T] int64 -> cos, sin [T, D] in `dtype`
        freqs = positions.unsqueeze(-1).float() * self.inv_freq.float()  # [3, T, D/2]
        index = self.section_rows.view(1, 1, -1).expand(1, freqs.shape[1], -1)  # [1, T, D/2]
        freqs = freqs.gather(0, index).squeeze(0)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Qwen2Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, attention: AttentionBackend, all_reduce: AllReduce | None
    ) -> None:
        super().__init__()
        self.all_reduce = all_reduce
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.attention = attention
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D] (see rotary_tables)
        sin: torch.Tensor,  # [T, 1, D] sign-folded sin
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        # q and k heads are adjacent in qkv: rotate them together, in one pass.
        qk = qkv[:, : self.q_size + self.kv_size].view(
            num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
        )  # [T, H + KVH, D]
        if self.q_norm is not None:
            qk = self._norm_heads(qk)
        v = qkv[:, self.q_size + self.kv_size :].view(
            num_tokens, self.num_kv_heads, self.head_dim
        )  # [T, KVH, D]
        # Rotary on q and k, the K/V write and attention (rotary and the write in one
        # kernel on the FlashInfer backend).
        out = self.attention.rotate_and_forward(
            qk, v, cos, sin, kv_cache, attn_metadata, self.scale
        )  # [T, H, D]
        out = self.o_proj(out.reshape(num_tokens, self.q_size))  # [T, hidden]
        return out if self.all_reduce is None else self.all_reduce(out)

    def _norm_heads(self, qk: torch.Tensor) -> torch.Tensor:  # [T, H + KVH, D], a new tensor
        """Qwen3's q_norm and k_norm: each head normalised over head_dim, with its weights."""
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)  # type: ignore[misc]
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)  # type: ignore[misc]
        return torch.cat((q, k), dim=1)


class Qwen2MLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, all_reduce: AllReduce | None = None
    ) -> None:
        super().__init__()
        self.all_reduce = all_reduce
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.act = SiluAndMul()
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        out = self.down_proj(self.act(self.gate_up_proj(x)))
        return out if self.all_reduce is None else self.all_reduce(out)


class Qwen2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend,
        all_reduce: AllReduce | None,
        index: int = 0,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen2Attention(config, attention, all_reduce)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if config.moe is not None and index in config.moe.sparse_layers:
            self.mlp = SparseMoE(config.hidden_size, config.moe)
        else:
            self.mlp = Qwen2MLP(config.hidden_size, config.intermediate_size, all_reduce)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] the previous layer's MLP output (the embeddings first)
        residual: torch.Tensor | None,  # [T, hidden] the residual stream before x is added
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # this layer's MLP output, residual stream
        """transformers' `h = h + attn(norm(h)); h = h + mlp(norm(h))`, with each residual
        add deferred into the next norm, where CUDA runs add and norm as one kernel."""
        hidden, residual = self.input_layernorm.add_forward(x, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class Qwen2Decoder(nn.Module):
    """Token embedding, the decoder layers and the final norm (no LM head)."""

    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend,
        all_reduce: AllReduce | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [
                Qwen2DecoderLayer(config, attention, all_reduce, index)
                for index in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = MRotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.mrope_section,
            config.llama3_rope_scaling,
            interleaved=config.mrope_interleaved,
        )

    def forward(
        self,
        embeds: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [3, T] int64
        kv_caches: list[torch.Tensor],  # per layer [num_blocks, 2, block_size, KVH, D]
        attn_metadata: AttentionMetadata,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """`deepstack` (Qwen3-VL): media rows [M] and their levels [M, L, hidden]; level i
        is added to the hidden states at those rows after layer i, as transformers does."""
        cos, sin = rotary_tables(*self.rotary(positions, embeds.dtype))  # [T, 1, D] each
        x, residual = embeds, None
        num_levels = 0 if deepstack is None else deepstack[1].shape[1]
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, cos, sin, kv_cache, attn_metadata)
            if index < num_levels:
                rows, levels = deepstack  # type: ignore[misc]
                hidden = x if residual is None else residual + x  # the reference's order
                x, residual = hidden.index_add(0, rows, levels[:, index]), None
        return self.norm.add_forward(x, residual)[0]
