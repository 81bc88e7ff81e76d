"""Benchmark (not a test; needs a GPU): the decoder's projections at decode batch sizes,
cuBLAS (`F.linear`) against the small-batch Triton kernel (kernels/triton/small_batch_linear.py).

    PYTHONPATH=. python3 bench/gpu_gemv.py [--sizes qwen2-vl-2b qwen2-vl-7b] [--rows 1 2 4 8]

For each size's four projections (fused QKV with its bias, output, fused gate_up, down)
and each row count, a CUDA graph runs the projection once per decoder layer, each layer
with its own weight (as a decode step does, so the weights come from memory and not from
L2), and is replayed; the time of one call is the replay's over the layers. Prints µs per
call and the bandwidth it reaches (weight bytes / time) for cuBLAS, the kernel with its
default blocks (`pick_blocks`) and, at the rows of --sweep-rows, the best of a small grid
of blocks; and the largest difference from the exact (float64) product, cuBLAS's and the
kernel's, in units of the output dtype's rounding at the largest output. The last line is the sum over one
decode step (each projection once per layer): what `--small-batch-linear-rows` would save.

`--device cpu` is a smoke run for the tests: tiny shapes under Triton's interpreter.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from engine.tiny_sizes import SIZES

SWEEP_BLOCK_N = (1, 2, 4, 8, 16)
SWEEP_BLOCK_K = (256, 512, 1024, 2048)
SWEEP_WARPS = (4, 8)
SWEEP_PRODUCT_ELEMENTS = 16384  # configs holding more partial sums a program are skipped


@dataclass(frozen=True)
class Projection:
    name: str
    out_features: int
    in_features: int
    has_bias: bool


@dataclass(frozen=True)
class GemvResult:
    size: str
    projection: str
    rows: int
    cublas_us: float
    kernel_us: float  # default blocks
    best_us: float  # best of the sweep (the default's time where not swept)
    best_blocks: str
    weight_bytes: int
    cublas_error_units: float  # largest |result - exact| / rounding unit of max |exact|
    kernel_error_units: float


def projections(size: str) -> list[Projection]:
    spec = SIZES[size]
    head_dim = spec.hidden_size // spec.num_attention_heads
    kv = spec.num_key_value_heads * head_dim
    return [
        Projection("qkv", spec.hidden_size + 2 * kv, spec.hidden_size, True),
        Projection("o", spec.hidden_size, spec.hidden_size, False),
        Projection("gate_up", 2 * spec.intermediate_size, spec.hidden_size, False),
        Projection("down", spec.hidden_size, spec.intermediate_size, False),
    ]


def time_us(run: Callable[[], None], calls: int, replays: int, device: torch.device) -> float:
    """Microseconds per call of `run`, which makes `calls` calls: a CUDA graph's replay on a
    GPU (no launch gaps from Python), the host clock under the interpreter."""
    run()  # compiles, autotunes nothing, allocates
    if device.type != "cuda":
        import time

        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1000 / (replays * calls)


def error_units(result: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest |result - exact|, in units of the output dtype's rounding step at the largest
    |exact| (a relative error per element would blow up where the sum cancels to ~0)."""
    unit = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}[result.dtype]
    return ((result.double() - exact).abs().max() / (exact.abs().max() * unit)).item()


def sweep_grid(rows: int, in_features: int) -> list:
    from kernels.triton.small_batch_linear import Blocks

    padded = 1 << (rows - 1).bit_length()
    return [
        Blocks(n, k, warps)
        for n, k, warps in itertools.product(SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_WARPS)
        if padded * n * k <= SWEEP_PRODUCT_ELEMENTS and k <= max(256, 2 * in_features)
    ]


def bench_projection(size: str, projection: Projection, rows: int, layers: int,
                     args: argparse.Namespace) -> GemvResult:  # fmt: skip
    from kernels.triton.small_batch_linear import small_batch_linear

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    generator = torch.Generator(device=device).manual_seed(rows)
    shape = (projection.out_features, projection.in_features)
    weights = [torch.randn(shape, generator=generator, device=device).mul_(0.02).to(dtype)
               for _ in range(layers)]  # fmt: skip
    biases = [torch.randn(shape[0], generator=generator, device=device).to(dtype)
              if projection.has_bias else None for _ in range(layers)]  # fmt: skip
    x = torch.randn(rows, shape[1], generator=generator, device=device).to(dtype)
    out = torch.empty(rows, shape[0], device=device, dtype=dtype)

    def cublas() -> None:
        for weight, bias in zip(weights, biases, strict=True):
            out.copy_(F.linear(x, weight, bias))

    def kernel(blocks=None) -> Callable[[], None]:
        def run() -> None:
            for weight, bias in zip(weights, biases, strict=True):
                out.copy_(small_batch_linear(x, weight, bias, blocks))

        return run

    exact = x.double() @ weights[0].double().T
    if biases[0] is not None:
        exact += biases[0].double()
    cublas_error = error_units(F.linear(x, weights[0], biases[0]), exact)
    kernel_error = error_units(small_batch_linear(x, weights[0], biases[0]), exact)
    cublas_us = time_us(cublas, layers, args.replays, device)
    kernel_us = time_us(kernel(), layers, args.replays, device)
    best_us, best_blocks = kernel_us, "default"
    if rows in args.sweep_rows:
        for blocks in sweep_grid(rows, shape[1]):
            us = time_us(kernel(blocks), layers, args.replays, device)
            if us < best_us:
                best_us, best_blocks = us, f"{blocks.block_n}x{blocks.block_k}/{blocks.num_warps}w"
    weight_bytes = weights[0].numel() * weights[0].element_size()
    return GemvResult(size, projection.name, rows, cublas_us, kernel_us, best_us, best_blocks,
                      weight_bytes, cublas_error, kernel_error)  # fmt: skip


def format_row(r: GemvResult) -> str:
    def rate(us: float) -> str:
        return f"{r.weight_bytes / us / 1e6:.2f}"

    return (
        f"| {r.size} | {r.projection} | {r.rows} | {r.cublas_us:.2f} ({rate(r.cublas_us)}) | "
        f"{r.kernel_us:.2f} ({rate(r.kernel_us)}) | {r.best_us:.2f} {r.best_blocks} | "
        f"{r.kernel_us / r.cublas_us:.2f} | {r.cublas_error_units:.2f} / {r.kernel_error_units:.2f} |"
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["qwen2-vl-2b", "qwen2-vl-7b"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--sweep-rows", nargs="*", type=int, default=[1],
                        help="row counts at which a grid of blocks is timed too")  # fmt: skip
    parser.add_argument(
        "--layers", type=int, help="weights per projection (default: the size's layers)"
    )
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (interpreter)")
    parser.add_argument("--out", help="write the results as JSON here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported
    elif not torch.cuda.is_available():
        print("no CUDA device (pass --device cpu for a smoke run)", file=sys.stderr)
        return 2
    results = []
    for size in args.sizes:
        layers = args.layers or SIZES[size].num_hidden_layers
        for projection, rows in itertools.product(projections(size), args.rows):
            result = bench_projection(size, projection, rows, layers, args)
            print(format_row(result), file=sys.stderr)
            results.append(result)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    print(f"device: {name}; µs per call (TB/s of weight read)")
    print(
        "| size | projection | rows | cuBLAS | kernel | best of sweep | kernel/cuBLAS | error units cuBLAS / kernel |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for result in results:
        print(format_row(result))
    for size, rows in itertools.product(args.sizes, args.rows):
        step = [r for r in results if r.size == size and r.rows == rows]
        layers = args.layers or SIZES[size].num_hidden_layers
        cublas = sum(r.cublas_us for r in step) * layers
        kernel = sum(min(r.cublas_us, r.kernel_us) for r in step) * layers
        print(f"{size}, {rows} rows, one decode step's projections: cuBLAS {cublas:.0f} µs, "
              f"with the kernel where faster {kernel:.0f} µs")  # fmt: skip
    if args.out:
        import json
        from pathlib import Path

        Path(args.out).write_text(json.dumps({"device": name, "config": vars(args),
                                              "results": [asdict(r) for r in results]}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
