"""FlashInfer attention backend (GPU): paged KV cache in FlashInfer's "NHD" layout, which is
the layout of `engine.attention.base`, so no copy or reshape is ever needed.

Eager steps (the first layer to see a new `AttentionMetadata`):
    host lists (query_lens, seq_lens) -> CSR page table, pinned   (kernels.flashinfer_glue)
    block_tables[flat index] -> kv_indices on the device           (no host sync)
    wrapper.plan(...)                                               (decode-only: decode wrapper)
Per layer:
    rotary on q and k, and K/V into their slots: one Triton kernel
    (kernels/triton/rotary_kv_write.py; FP8 E4M3 with per-tensor scales)
    wrapper.run(query, kv_cache)

Decode steps in CUDA graphs use one `GraphDecodeWrapper` per captured batch size, planned
by `plan_cuda_graph` on the host before every replay; `forward` under such metadata only
writes K/V and runs, which is what the graph captures. With `triton_graph_decode` (a class
switch for bench/gpu_decode.py's `graphs-triton-decode` mode, off by default until a GPU
session has measured it) they run `kernels/triton/paged_decode_attention.py` instead, which
reads the graph's block tables and lengths on the device: no plan before a replay.

Rotary embeddings (M-RoPE for Qwen2-VL) are applied before the cache write
(`rotate_and_forward`; `forward` takes K already rotated), so the cache holds rotated keys
and FlashInfer runs with `pos_encoding_mode="NONE"`. FlashInfer has float16 / bfloat16
kernels only (FP8 for the cache): float32 models use the torch backend
(`engine.attention.check_attention_backend` says so at start-up).

Importing this module fails with ImportError when flashinfer is not installed; the engine
imports it only when `--attention-backend flashinfer` is chosen.
"""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.base import AttentionMetadata, AttentionShape, RotateThenForward
from kernels import flashinfer_glue
from kernels.reference import FP8_DTYPE

if importlib.util.find_spec("flashinfer") is None:
    raise ImportError(
        "flashinfer is not installed; install the GPU extra: pip install 'tessera[gpu]'"
    )


class FlashInferAttentionBackend(RotateThenForward):
    """`engine.attention.base.AttentionBackend` over FlashInfer's batch prefill/decode wrappers.

    One instance serves every layer of a model: all layers of a step share one plan, made
    when `forward` first sees that step's metadata object. `k_scale`/`v_scale` are the
    per-tensor dequantisation scales of an FP8 (float8_e4m3fn) cache; other caches ignore
    them.
    """

    name = "flashinfer"
    # Rotary and the K/V write in one kernel (`rotate_and_forward`). A switch for
    # bench/gpu_decode.py's `graphs-unfused` mode, which measures the two kernels.
    fuse_rotary_kv_write = True
    # Graph-captured decode steps on the Triton split-KV kernel instead of FlashInfer's (a
    # switch for bench/gpu_decode.py's `graphs-triton-decode` mode).
    triton_graph_decode = False

    def __init__(
        self,
        shape: AttentionShape,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        *,
        max_graph_batch: int = 1,
    ) -> None:
        self.shape = shape
        # The largest captured decode batch (0: none): its plan's split-KV tiles size the
        # workspace.
        self.max_graph_batch = max_graph_batch
        self._geometry = flashinfer_glue.PlanGeometry(
            num_qo_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            block_size=shape.block_size,
            scale=shape.scale,
            q_dtype=shape.dtype,
            kv_dtype=shape.kv_cache_dtype,
        )
        self.k_scale = k_scale
        self.v_scale = v_scale
        self._wrappers: flashinfer_glue.FlashInferWrappers | None = None
        self._graph_wrappers: dict[int, flashinfer_glue.GraphDecodeWrapper] = {}
        # Holding the planned metadata keeps it alive, so an identity test cannot be fooled
        # by a new step's metadata reusing a freed object's id.
        self._planned_metadata: AttentionMetadata | None = None
        self._scale_tensors: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._last_plan_copied: torch.cuda.Event | None = None
        self.fuse_rotary_kv_write = type(self).fuse_rotary_kv_write  # fixed from here on
        self.triton_graph_decode = type(self).triton_graph_decode

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D], rotary already applied
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        self._check(query, kv_cache, scale)
        self._write_kv(key, value, kv_cache, metadata.slot_mapping)
        return self._attend(query, kv_cache, metadata)

    def rotate_and_forward(
        self,
        qk: torch.Tensor,  # [T, H + KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        cos: torch.Tensor,  # [T, 1, D]
        signed_sin: torch.Tensor,  # [T, 1, D]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        """Rotary and the K/V write in one Triton kernel (rotated K goes to the cache from
        registers), then attention: one launch a layer fewer than `RotateThenForward`'s,
        with the same bytes in qk and the cache."""
        if not self.fuse_rotary_kv_write:
            return super().rotate_and_forward(qk, value, cos, signed_sin, kv_cache, metadata, scale)
        from kernels.triton.rotary_kv_write import rotary_kv_write_

        self._check(qk, kv_cache, scale)
        scales = self._scales_on(kv_cache.device) if kv_cache.dtype == FP8_DTYPE else ()
        rotary_kv_write_(qk, value, cos, signed_sin, kv_cache, metadata.slot_mapping, *scales)
        return self._attend(qk[:, : qk.shape[1] - value.shape[1]], kv_cache, metadata)

    def _check(self, query: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> None:
        if not query.is_cuda:
            raise ValueError("the flashinfer attention backend needs CUDA tensors")
        if scale != self.shape.scale or kv_cache.shape[2] != self.shape.block_size:
            raise ValueError("attention scale or block size differs from the planned shape")

    def _attend(
        self,
        query: torch.Tensor,  # [T, H, D]
        kv_cache: torch.Tensor,  # this step's K/V written
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        is_fp8 = kv_cache.dtype == FP8_DTYPE
        k_scale = self.k_scale if is_fp8 else None
        v_scale = self.v_scale if is_fp8 else None
        if metadata.is_cuda_graph and self.triton_graph_decode:
            return self._triton_decode(query, kv_cache, metadata)
        if metadata.is_cuda_graph:  # planned on the host by plan_cuda_graph
            wrapper = self._graph_wrappers[metadata.num_seqs]
            return wrapper.run(query, kv_cache, k_scale=k_scale, v_scale=v_scale)
        wrappers = self._plan_if_new_step(kv_cache, metadata)
        return wrappers.run(query, kv_cache, k_scale=k_scale, v_scale=v_scale)

    def _triton_decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:  # [S, H, D]
        from kernels.triton.paged_decode_attention import paged_decode_attention

        scales = self._scales_on(kv_cache.device) if kv_cache.dtype == FP8_DTYPE else ()
        return paged_decode_attention(query, kv_cache, metadata.block_tables,
                                      metadata.seq_lens_tensor, self.shape.scale, *scales)  # fmt: skip

    def plan_cuda_graph(self, metadata: AttentionMetadata) -> None:
        if self.triton_graph_decode:
            return  # the kernel reads the graph's block tables and lengths on the device
        batch_size, width = metadata.block_tables.shape
        wrapper = self._graph_wrappers.get(batch_size)
        if wrapper is None:
            wrapper = flashinfer_glue.GraphDecodeWrapper(
                self._eager_wrappers(metadata.block_tables.device).workspace,
                batch_size,
                max_pages=batch_size * width,
            )
            self._graph_wrappers[batch_size] = wrapper
        self._plan(wrapper, metadata)

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

    def workspace_bytes(self, device: torch.device) -> int:
        """FlashInfer's recommended 128 MiB, or what this model's split-KV plans can take
        on this device when that is more (wide query-head groups on many SMs)."""
        properties = torch.cuda.get_device_properties(device)
        needed = flashinfer_glue.split_kv_workspace_bytes(
            self._geometry, properties.multi_processor_count, self.max_graph_batch,
            properties.major,
        )  # fmt: skip
        return max(flashinfer_glue.DEFAULT_WORKSPACE_BYTES, needed)

    def _eager_wrappers(self, device: torch.device) -> flashinfer_glue.FlashInferWrappers:
        if self._wrappers is None:
            self._wrappers = flashinfer_glue.FlashInferWrappers(
                device, self.workspace_bytes(device)
            )
        return self._wrappers

    def _plan_if_new_step(
        self,
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KVH, D]
        metadata: AttentionMetadata,
    ) -> flashinfer_glue.FlashInferWrappers:
        wrappers = self._eager_wrappers(kv_cache.device)
        if metadata is self._planned_metadata:
            return wrappers
        self._plan(wrappers, metadata)
        self._planned_metadata = metadata
        return wrappers

    def _plan(
        self,
        wrapper: flashinfer_glue.FlashInferWrappers | flashinfer_glue.GraphDecodeWrapper,
        metadata: AttentionMetadata,
    ) -> None:
        """The step's CSR page table from its host lists (pinned), the page ids gathered on
        the device, then FlashInfer's plan."""
        plan = flashinfer_glue.build_paged_kv_plan(
            metadata.query_lens,
            metadata.seq_lens,
            self.shape.block_size,
            metadata.block_tables.shape[1],
            pin_memory=True,
        )
        kv_indices = flashinfer_glue.gather_page_indices(metadata.block_tables, plan)
        # FlashInfer's plan() fills a pinned host buffer, reused by every plan, and queues
        # its copy to the device. With overlap scheduling this step is planned while the
        # last one may not have reached that copy yet: wait until it has (the device has
        # finished the step before it, so this is the start of the step now running).
        if self._last_plan_copied is not None:
            self._last_plan_copied.synchronize()
        wrapper.plan(plan, kv_indices, self._geometry)
        self._last_plan_copied = torch.cuda.Event()
        self._last_plan_copied.record()
