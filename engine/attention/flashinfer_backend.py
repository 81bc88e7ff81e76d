"""FlashInfer attention backend (GPU): paged KV cache in FlashInfer's "NHD" layout, which is
the layout of `engine.attention.base`, so no copy or reshape is ever needed.

Per step (the first layer to see a new `AttentionMetadata`):
    host lists (query_lens, seq_lens) -> CSR page table  (kernels.flashinfer_glue)
    block_tables[flat index] -> kv_indices on the device (no host sync)
    wrapper.plan(...)                                     (decode-only: decode wrapper)
Per layer:
    write K/V into their slots (Triton kernel; FP8 E4M3 with per-tensor scales)
    wrapper.run(query, kv_cache)

Rotary embeddings (M-RoPE for Qwen2-VL) are applied by the model before `forward`, so the
cache holds rotated keys and FlashInfer runs with `pos_encoding_mode="NONE"`.

Importing this module fails with ImportError when flashinfer is not installed; the engine
imports it only when `--attention-backend flashinfer` is chosen.
"""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.base import AttentionMetadata
from kernels import flashinfer_glue
from kernels.reference import FP8_DTYPE

if importlib.util.find_spec("flashinfer") is None:
    raise ImportError(
        "flashinfer is not installed; install the GPU extra: pip install 'tessera[gpu]'"
    )

_PlanKey = tuple[int, int, int, float, torch.dtype, torch.dtype]


class FlashInferAttentionBackend:
    """`engine.attention.base.AttentionBackend` over FlashInfer's batch prefill/decode wrappers.

    One instance serves every layer of a model: all layers of a step share one plan, made
    when `forward` first sees that step's metadata object. `k_scale`/`v_scale` are the
    per-tensor dequantisation scales of an FP8 (float8_e4m3fn) cache; other caches ignore
    them.
    """

    name = "flashinfer"

    def __init__(
        self,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        workspace_bytes: int = flashinfer_glue.DEFAULT_WORKSPACE_BYTES,
    ) -> None:
        self.k_scale = k_scale
        self.v_scale = v_scale
        self._workspace_bytes = workspace_bytes
        self._wrappers: flashinfer_glue.FlashInferWrappers | None = None
        # Holding the planned metadata keeps it alive, so an identity test cannot be fooled
        # by a new step's metadata reusing a freed object's id.
        self._planned_metadata: AttentionMetadata | None = None
        self._planned_key: _PlanKey | None = None
        self._scale_tensors: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D], rotary already applied
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        if not query.is_cuda:
            raise ValueError("the flashinfer attention backend needs CUDA tensors")
        self._write_kv(key, value, kv_cache, metadata.slot_mapping)
        wrappers = self._plan_if_new_step(query, kv_cache, metadata, scale)
        is_fp8 = kv_cache.dtype == FP8_DTYPE
        return wrappers.run(
            query,
            kv_cache,
            k_scale=self.k_scale if is_fp8 else None,
            v_scale=self.v_scale if is_fp8 else None,
        )

    def _write_kv(
        self,
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        from kernels.triton.kv_cache_write import write_kv_cache

        if kv_cache.dtype != FP8_DTYPE:
            write_kv_cache(key, value, kv_cache, slot_mapping)
            return
        k_scale, v_scale = self._scales_on(kv_cache.device)
        write_kv_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)

    def _scales_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 scales as [1] float32 device tensors, made once per device."""
        if device not in self._scale_tensors:
            self._scale_tensors[device] = (
                torch.tensor([self.k_scale], dtype=torch.float32, device=device),
                torch.tensor([self.v_scale], dtype=torch.float32, device=device),
            )
        return self._scale_tensors[device]

    def _plan_if_new_step(
        self,
        query: torch.Tensor,  # [T, H, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
        metadata: AttentionMetadata,
        scale: float,
    ) -> flashinfer_glue.FlashInferWrappers:
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = kv_cache.shape[3]
        plan_key: _PlanKey = (num_heads, num_kv_heads, head_dim, scale, query.dtype, kv_cache.dtype)
        wrappers = self._wrappers
        if wrappers is None:
            wrappers = flashinfer_glue.FlashInferWrappers(query.device, self._workspace_bytes)
            self._wrappers = wrappers
        if metadata is self._planned_metadata and plan_key == self._planned_key:
            return wrappers
        block_size = kv_cache.shape[2]
        plan = flashinfer_glue.build_paged_kv_plan(
            metadata.query_lens, metadata.seq_lens, block_size, metadata.block_tables.shape[1]
        )
        wrappers.plan(
            plan,
            flashinfer_glue.gather_page_indices(metadata.block_tables, plan),
            num_qo_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            scale=scale,
            q_dtype=query.dtype,
            kv_dtype=kv_cache.dtype,
        )
        self._planned_metadata = metadata
        self._planned_key = plan_key
        return wrappers
