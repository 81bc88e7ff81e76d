"""The torch device and dtypes that an EngineConfig's names (`--device`, `--dtype`,
`--kv-cache-dtype`) resolve to on this machine, and what a device cannot run."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from engine.config import KV_CACHE_DTYPES

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def usable_device(name: str, setting: str = "--device") -> torch.device:
    """A device name (cpu, cuda, cuda:N), or ValueError saying why it cannot be used, and
    naming it as `setting` (a command's flag; the server's setting name, which its error
    follows with the flag, variable or YAML file that set it)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"{setting} must be cpu or cuda, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{setting} {name}: no CUDA device is available")
    if device.type == "cuda" and (device.index or 0) >= (count := torch.cuda.device_count()):
        raise ValueError(
            f"{setting} {name}: this machine has {count} CUDA device(s), cuda:0-{count - 1}"
        )
    return device


def check_tensor_parallel_device(tensor_parallel_size: int, device: torch.device) -> None:
    """ValueError unless `device` can run `tensor_parallel_size` ranks: the shard workers
    talk over gloo (engine/shard_worker.py), so more than one runs on CPU only."""
    if tensor_parallel_size > 1 and device.type != "cpu":
        raise ValueError(
            "tensor_parallel_size > 1 runs on CPU (gloo) only: the NCCL path is not built "
            "yet; use --tensor-parallel-size 1 on a GPU"
        )


def resolve_dtype(
    name: str, device: torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """`auto`: bfloat16 on CUDA; on CPU bfloat16 only for a bfloat16 checkpoint on a CPU
    with native bf16 matmuls (AVX512-BF16 / AMX: about 2x float32 there), else float32."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        if checkpoint_dtype == "bfloat16" and cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, scale: float) -> torch.dtype:
    """`auto`: the model dtype; `fp8`: float8_e4m3fn storing `x / scale` (1 byte/element)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown kv_cache_dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"kv_cache_scale must be a positive finite number, got {scale}")
    return model_dtype if name == "auto" else torch.float8_e4m3fn


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists avx512_bf16 or amx_bf16 (False where it cannot be read)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
