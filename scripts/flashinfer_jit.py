"""JIT-compile FlashInfer's attention modules ahead of serving (CUDA machine only).

    python3 scripts/flashinfer_jit.py --head-dim 128 --kv-cache-dtype auto fp8
    python3 scripts/flashinfer_jit.py --kv-cache-dtype auto --backend fa3   # bench only

FlashInfer builds one module per (dtype, KV cache dtype, head dim) the first time a step
needs it, about a minute each, and keeps it under ~/.cache/flashinfer
(FLASHINFER_WORKSPACE_BASE moves it). This builds the modules named here, each in its own
process so they compile side by side, and prints how long each took. Qwen2-VL 2B and 7B
both have head dim 128.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def compile_one(dtype_name: str, kv_cache_dtype: str, head_dim: int, num_heads: int,
                num_kv_heads: int, backend: str) -> None:  # fmt: skip
    import torch

    from kernels import flashinfer_glue
    from kernels.flashinfer_glue import PlanGeometry, compile_kernels
    from kernels.reference import FP8_DTYPE

    flashinfer_glue.FLASHINFER_BACKEND = backend  # the engine's is fa2; fa3 for a bench mode

    dtype = getattr(torch, dtype_name)
    geometry = PlanGeometry(
        num_qo_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        scale=head_dim**-0.5,
        q_dtype=dtype,
        kv_dtype=FP8_DTYPE if kv_cache_dtype == "fp8" else dtype,
    )
    started = time.perf_counter()
    compile_kernels(torch.device("cuda"), geometry)
    print(f"{backend} {dtype_name} / KV {kv_cache_dtype} / head dim {head_dim}: "
          f"{time.perf_counter() - started:.0f} s")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[128])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"],
                        choices=["bfloat16", "float16"])  # fmt: skip
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto", "fp8"],
                        choices=["auto", "fp8"])  # fmt: skip
    parser.add_argument("--backend", nargs="+", default=["fa2"], choices=["fa2", "fa3"],
                        help="fa2: the engine's; fa3: bench/gpu_decode.py's graphs-fa3 mode")  # fmt: skip
    # A child process's single job.
    parser.add_argument("--one", nargs=4, metavar=("DTYPE", "KV", "HEAD_DIM", "BACKEND"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.one:
        dtype_name, kv, head_dim, backend = args.one
        compile_one(dtype_name, kv, int(head_dim), num_heads=8, num_kv_heads=2, backend=backend)
        return 0
    jobs = [(d, kv, str(h), b) for d in args.dtype for kv in args.kv_cache_dtype
            for h in args.head_dim for b in args.backend]  # fmt: skip
    children = [subprocess.Popen([sys.executable, __file__, "--one", *job]) for job in jobs]
    return max(child.wait() for child in children)


if __name__ == "__main__":
    sys.exit(main())
