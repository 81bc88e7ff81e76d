"""Benchmark (not a test; needs a GPU for numbers): one layer's decode attention, FlashInfer's
decode wrapper (the engine's) against the Triton split-KV kernel
(kernels/triton/paged_decode_attention.py) over a sweep of its knobs, against the floor of
the K and V bytes the call must read.

    PYTHONPATH=. python3 bench/gpu_decode_attention.py --batch-sizes 1 32 128 \\
        --context-lens 512 2048 --out attention.json

Each call is captured in a CUDA graph (ten calls a graph, as the decode graphs run them)
and replayed; the time is a call's share of the median replay. The shape defaults to
Qwen2-VL-2B's (12 query heads over 2 KV heads, head dim 128, bf16, blocks of 16 tokens);
every sequence's blocks are scattered over the cache. Each Triton configuration's output is
checked against FlashInfer's, or without it against `kernels.reference.paged_decode_attention`
(max |difference|, printed). On CPU (`--device cpu`) only the Triton kernel runs, under
the interpreter, untimed: a smoke run of the script.

The sweep has two phases a shape, so that a GPU call's minutes go further: every split count
(`--splits`) at the first tile / warps / stages listed, then every other combination of
`--block-n`, `--warps` and `--stages` at the split count that won the first phase (on CPU,
untimed, the first one listed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bench.gpu_decode import measure_bandwidth, median
from kernels.reference import paged_decode_attention as paged_decode_reference

CALLS_PER_GRAPH = 10


@dataclass(frozen=True)
class AttentionResult:
    batch_size: int
    context_len: int
    impl: str  # "flashinfer" or "triton splits=S block_n=N warps=W stages=T"
    us: float  # per call
    floor_us: float
    max_abs_diff: float | None  # against FlashInfer's output or the reference's

    @property
    def ratio(self) -> float:
        return self.us / self.floor_us if self.floor_us else float("nan")


@dataclass(frozen=True)
class Batch:
    query: torch.Tensor  # [S, H, D]
    cache: torch.Tensor  # [blocks, 2, block_size, KVH, D]
    tables: torch.Tensor  # [S, W] int32
    seq_lens: torch.Tensor  # [S] int32
    scale: float


def make_batch(args: argparse.Namespace, batch_size: int, context_len: int) -> Batch:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    width = -(-context_len // args.block_size)
    num_blocks = batch_size * width
    generator = torch.Generator(device=device).manual_seed(batch_size * 7919 + context_len)
    cache = torch.randn(num_blocks, 2, args.block_size, args.kv_heads, args.head_dim,
                        device=device, generator=generator).to(dtype)  # fmt: skip
    tables = torch.randperm(num_blocks, device=device, generator=generator)
    tables = tables.view(batch_size, width).to(torch.int32)
    seq_lens = torch.full((batch_size,), context_len, dtype=torch.int32, device=device)
    query = torch.randn(batch_size, args.heads, args.head_dim, device=device,
                        generator=generator).to(dtype)  # fmt: skip
    return Batch(query, cache, tables, seq_lens, args.head_dim**-0.5)


def flashinfer_call(batch: Batch, args: argparse.Namespace) -> Callable[[], torch.Tensor]:
    """FlashInfer's graph decode wrapper, planned once for this batch (the engine plans it on
    the host before every replay; the plan is not timed here)."""
    from kernels import flashinfer_glue

    geometry = flashinfer_glue.PlanGeometry(
        num_qo_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        block_size=args.block_size, scale=batch.scale, q_dtype=batch.query.dtype,
        kv_dtype=batch.cache.dtype,
    )  # fmt: skip
    num_seqs, width = batch.tables.shape
    workspace = torch.empty(flashinfer_glue.DEFAULT_WORKSPACE_BYTES, dtype=torch.uint8,
                            device=batch.query.device)  # fmt: skip
    wrapper = flashinfer_glue.GraphDecodeWrapper(workspace, num_seqs, num_seqs * width)
    lens = batch.seq_lens.tolist()
    plan = flashinfer_glue.build_paged_kv_plan([1] * num_seqs, lens, args.block_size, width,
                                               pin_memory=True)  # fmt: skip
    wrapper.plan(plan, flashinfer_glue.gather_page_indices(batch.tables, plan), geometry)
    return lambda: wrapper.run(batch.query, batch.cache)


@dataclass(frozen=True)
class TritonConfig:
    splits: int | None  # None: the kernel's own choice
    block_n: int
    warps: int
    stages: int | None  # None: Triton's default

    @property
    def name(self) -> str:
        return (f"triton splits={self.splits or 'auto'} block_n={self.block_n} "
                f"warps={self.warps} stages={self.stages or 'default'}")  # fmt: skip


def triton_call(batch: Batch, config: TritonConfig) -> Callable[[], torch.Tensor]:
    from kernels.triton.paged_decode_attention import paged_decode_attention

    return lambda: paged_decode_attention(batch.query, batch.cache, batch.tables, batch.seq_lens,
                                          batch.scale, num_splits=config.splits,
                                          block_n=config.block_n, num_warps=config.warps,
                                          num_stages=config.stages)  # fmt: skip


def time_call(call: Callable[[], torch.Tensor], repeats: int) -> float:
    """Microseconds a call, from replays of a CUDA graph of CALLS_PER_GRAPH calls."""
    for _ in range(3):  # compile and warm up outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS_PER_GRAPH)
    return median(times)


def split_configs(args: argparse.Namespace) -> list[TritonConfig]:
    """The first phase: every split count at the first tile, warps and stages listed."""
    return [TritonConfig(None if s == 0 else s, args.block_n[0], args.warps[0],
                         args.stages[0] or None) for s in args.splits]  # fmt: skip


def tile_configs(args: argparse.Namespace, splits: int | None) -> list[TritonConfig]:
    """The second phase: the other tiles, warps and stages at the first phase's winner."""
    grid = itertools.product(args.block_n, args.warps, args.stages)
    configs = [TritonConfig(splits, n, w, s or None) for n, w, s in grid]
    return configs[1:]  # the first is the first phase's


def bench(args: argparse.Namespace, bandwidth: float) -> list[AttentionResult]:
    on_gpu = args.device == "cuda"
    results = []
    for batch_size, context_len in itertools.product(args.batch_sizes, args.context_lens):
        batch = make_batch(args, batch_size, context_len)
        kv_bytes = 2 * batch.cache[0, 0, 0].numel() * batch.cache.element_size()
        floor_us = batch_size * context_len * kv_bytes / bandwidth * 1e6 if on_gpu else 0.0
        if on_gpu and not args.no_flashinfer:
            call = flashinfer_call(batch, args)
            reference = call().float()
            us = time_call(call, args.repeats)
            results.append(AttentionResult(batch_size, context_len, "flashinfer", us, floor_us,
                                           None))  # fmt: skip
            print(format_row(results[-1]), file=sys.stderr)
        else:
            reference = paged_decode_reference(
                batch.query, batch.cache, batch.tables, batch.seq_lens, batch.scale
            ).float()
        shape = AttentionResult(batch_size, context_len, "", 0.0, floor_us, None)
        timed = {}
        for config in split_configs(args):
            timed[config] = run_triton(batch, config, reference, shape, args.repeats)
        best = min(timed, key=lambda config: timed[config].us)  # the first one on CPU
        for config in tile_configs(args, best.splits):
            timed[config] = run_triton(batch, config, reference, shape, args.repeats)
        results.extend(timed.values())
    return results


def run_triton(batch: Batch, config: TritonConfig, reference: torch.Tensor,
               shape: AttentionResult, repeats: int) -> AttentionResult:  # fmt: skip
    """One configuration's time (untimed, 0, on CPU) and its largest difference from
    `reference`, in a copy of `shape`'s row; printed as it comes."""
    call = triton_call(batch, config)
    diff = float((call().float() - reference).abs().max())
    us = time_call(call, repeats) if batch.query.is_cuda else 0.0
    result = replace(shape, impl=config.name, us=us, max_abs_diff=diff)
    print(format_row(result), file=sys.stderr)
    return result


def format_row(r: AttentionResult) -> str:
    diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.1e}"
    return (f"| {r.batch_size} | {r.context_len} | {r.impl} | {r.us:.2f} | {r.floor_us:.2f} | "
            f"{r.ratio:.2f} | {diff} |")  # fmt: skip


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32, 128])
    parser.add_argument("--context-lens", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--splits", nargs="+", type=int, default=[0],
                        help="Triton split counts to try (0: the kernel's default)")  # fmt: skip
    parser.add_argument("--block-n", nargs="+", type=int, default=[32])
    parser.add_argument("--warps", nargs="+", type=int, default=[4])
    parser.add_argument("--stages", nargs="+", type=int, default=[0],
                        help="Triton num_stages to try (0: Triton's default)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-flashinfer", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", help="JSON results")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    bandwidth = measure_bandwidth(torch.device("cuda")) if args.device == "cuda" else 0.0
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {name}, copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)",
          file=sys.stderr)  # fmt: skip
    started = time.perf_counter()
    results = bench(args, bandwidth)
    print("| batch | context | impl | us | floor us | ratio | max abs diff |", file=sys.stderr)
    print("|---|---|---|---|---|---|---|", file=sys.stderr)
    for result in results:
        print(format_row(result), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "device": name, "bandwidth_bytes_per_s": bandwidth,
            "seconds": time.perf_counter() - started,
            "results": [asdict(r) | {"ratio": r.ratio} for r in results],
        }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
