"""Triton kernels for the memory-bound work around attention, each beside its launcher
(which checks shapes, dtypes, devices and strides) and tested against its torch reference
in `kernels.reference`:

    kv_cache_write     write_kv_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    embedding_scatter  scatter_rows(dst, row_indices, src)
    token_gather       gather_rows(src, row_indices, out=None)  (built and tested; the
                       engine's `index_select` of the last rows is as fast, so unused)
    rms_norm           add_rms_norm(x, weight, eps, residual=None)  (the decoder's norms)
    rotary             rotary_folded_(qk, cos, signed_sin)  (in place on the QKV buffer)
    rotary_kv_write    rotary_kv_write_(qk, value, cos, signed_sin, kv_cache, slot_mapping,
                       k_scale, v_scale)  (the two above in one launch: the FlashInfer
                       backend's `rotate_and_forward`)
    silu_and_mul       silu_and_mul(x)  (the MLP activation)
    quick_gelu         quick_gelu(x)  (the Qwen2-VL vision tower's activation)
    small_batch_linear small_batch_linear(x, weight, bias=None)  (decode projections, <= 8 rows)
    paged_decode_attention  paged_decode_attention(query, kv_cache, block_tables, seq_lens,
                       scale, k_scale, v_scale)  (split-KV decode attention; the
                       FlashInfer backend's graph decode under `triton_graph_decode`, a
                       candidate not yet measured on a GPU)

Triton is optional (`pip install tessera[gpu]`): importing this package never imports it;
import the submodules only after `is_available()`. On CPU the kernels run under
`TRITON_INTERPRET=1` (tests only; slow).
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def is_available() -> bool:
    """True when triton is installed (the kernels then run on CUDA tensors, or on CPU
    tensors when TRITON_INTERPRET=1 was set before triton was imported)."""
    return importlib.util.find_spec("triton") is not None


def is_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 under the CPU interpreter): what the
    launchers size their grids by."""
    if device.type != "cuda":
        return 1
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]
