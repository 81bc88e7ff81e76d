"""Benchmark (not a test; needs a GPU for its numbers): where the engine's prefill steps of
issue 8's serving load spend their time.

    PYTHONPATH=. python3 bench/gpu_prefill.py --size qwen2-vl-2b --requests 128 \\
        --out prefill.json --profile-dir /tmp/profiles

Why: in issue 8's 2B serving run (docs/gpu.md, 2026-11-27) about 26 engine steps took
0.1-1.0 s each, against 2.5-10 ms for a decode step, and a request waited 450 ms on average
from being scheduled to its first token, while the FLOPs of a 16,384-token step take
~0.1 s at H100 rates. The server's step times of that run overlapped (a step launched
ahead counted the rest of the one before it, until 2026-11-27), and none of them says
which part of a step is slow; this script does.

--requests requests arrive at once, as a wave of issue 8's load: one --image-size image
(random pixels, distinct per request) and --prompt-len words of text each, one output
token each, into an in-process engine set up as the server's GPU config (token budget
--max-num-batched-tokens, FlashInfer, bf16, no prefix cache). Steps run serially
(no overlap), so that each one's host clock is its own. For every step until the wave
has its first tokens:

  tokens, images   what the step carried (prefill chunks; images encoded)
  wall             the step's host clock, launch to sampled tokens (EngineStats)
  encoder          device time of its vision encoder calls (CUDA events)
  forward          device time of its decoder forward
  other            wall - encoder - forward: host work the device waited for, embedding,
                   logits and sampling
  floor            the step's FLOPs (decoder GEMMs for every token, causal attention
                   products per chunk, LM head for sampled rows, the vision tower's FLOPs
                   as bench/gpu_vision.py counts them) over one large GEMM's measured rate

With --profile-dir, a second wave (other images) runs under torch.profiler: the busiest
host ops and device kernels to stderr, a Chrome trace to the folder. On CPU (`--device cpu
--size tiny --dtype float32 --attention-backend torch`) it is a smoke run of the script
(tests/unit/test_gpu_prefill_bench.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.datasets import image_chat_prompt, random_text
from bench.gpu_decode import ForwardTimer, ensure_model, print_top_ops
from bench.gpu_vision import frame_grid, measure_gemm_rate, tower_flops
from engine import LLM, SamplingParams
from engine.process import set_intra_op_threads


@dataclass(frozen=True)
class PrefillStep:
    tokens: int
    images: int
    wall_ms: float
    encoder_ms: float
    forward_ms: float
    floor_ms: float

    @property
    def other_ms(self) -> float:
        return self.wall_ms - self.encoder_ms - self.forward_ms

    @property
    def ratio(self) -> float:
        return self.wall_ms / self.floor_ms


def wave(args: argparse.Namespace, salt: int) -> list[dict]:
    """--requests chat prompts, each a distinct random image and --prompt-len words."""
    rng = random.Random(salt)
    return [image_chat_prompt(salt * 100_000 + index, args.image_size,
                              random_text(rng, args.prompt_len))
            for index in range(args.requests)]  # fmt: skip


class FlopCounter:
    """FLOPs of a step from what it carried (multiply-add = 2 FLOPs)."""

    def __init__(self, llm: LLM, image_size: int) -> None:
        model, config = llm.engine.runner.model, llm.engine.model_config
        self.layer_params = sum(p.numel() for p in model.model.layers.parameters())
        self.attention_width = config.num_attention_heads * config.head_dim
        self.num_layers = config.num_hidden_layers
        self.lm_head = config.hidden_size * config.vocab_size
        self.vision = config.vision
        self.grid = frame_grid(config.vision, image_size) if config.vision else None

    def step(self, chunks: list[tuple[int, int]], num_sampled: int, num_images: int) -> float:
        """`chunks`: (tokens before the chunk, tokens in it) of each prefill chunk."""
        tokens = sum(length for _, length in chunks)
        # Query i of a chunk starting at h sees h + i + 1 keys: QK^T and PV, every layer.
        keys = sum(start * length + length * (length + 1) // 2 for start, length in chunks)
        attention = 2 * 2 * self.attention_width * keys * self.num_layers
        flops = 2.0 * self.layer_params * tokens + attention + 2.0 * self.lm_head * num_sampled
        if num_images and self.vision is not None:
            flops += tower_flops(self.vision, [self.grid] * num_images)
        return flops


def run_wave(llm: LLM, timer: ForwardTimer, prompts: list[dict]) -> list[tuple]:
    """Generates one token for each prompt; per step: (EngineStats, forward ms, chunks
    [(start, length)], sampled rows)."""
    chunks_of_step: list[tuple[list[tuple[int, int]], int]] = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule():
        output = schedule()
        if not output.is_empty:
            chunks = [(c.start, c.num_tokens) for c in output.chunks]
            chunks_of_step.append((chunks, sum(1 for c in output.chunks if c.samples)))
        return output

    llm.engine.scheduler.schedule = recording_schedule
    try:
        results = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        del llm.engine.scheduler.schedule
    failed = [r.error for r in results if r.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    stats = [s for s in llm.last_stats if s.num_scheduled_tokens]
    forward_ms = timer.pop_ms()
    if not len(stats) == len(forward_ms) == len(chunks_of_step):
        raise RuntimeError(f"{len(stats)} steps, {len(forward_ms)} forwards, "
                           f"{len(chunks_of_step)} schedules")  # fmt: skip
    return [(s, f, *c) for s, f, c in zip(stats, forward_ms, chunks_of_step, strict=True)]


@torch.inference_mode()
def measure(args: argparse.Namespace) -> tuple[list[PrefillStep], dict]:
    device = torch.device(args.device)
    model_dir = ensure_model(Path(args.model_root), args.size, args.device)
    llm = LLM(str(model_dir), device=args.device, dtype=args.dtype,
              attention_backend=args.attention_backend, max_num_seqs=args.requests,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=4096,
              num_kv_blocks=args.requests * 4096 // 16 + 16, enable_prefix_caching=False,
              overlap_scheduling=False)  # fmt: skip
    set_intra_op_threads(llm.engine.config)  # as the server's engine process does
    timer = ForwardTimer(llm.engine)
    flops = FlopCounter(llm, args.image_size)
    rate = measure_gemm_rate(device, getattr(torch, args.dtype))
    run_wave(llm, timer, wave(args, salt=1)[:2])  # warm-up: kernels, JIT, allocator
    steps = []
    for stats, forward_ms, chunks, sampled in run_wave(llm, timer, wave(args, salt=2)):
        images = stats.vision_encoder_items_total
        floor_ms = flops.step(chunks, sampled, images) / rate * 1000
        steps.append(PrefillStep(stats.num_scheduled_tokens, images, stats.step_seconds * 1000,
                                 stats.vision_encoder_seconds * 1000, forward_ms,
                                 floor_ms))  # fmt: skip
    if args.profile_dir:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            run_wave(llm, timer, wave(args, salt=3))
        path = Path(args.profile_dir) / f"{args.size}-prefill-{args.requests}.json.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        print_top_ops(prof, f"{path.name}, one wave")
    context = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "gemm_tflops": rate / 1e12, **vars(args)}  # fmt: skip
    llm.close()
    return steps, context


def format_row(step: PrefillStep) -> str:
    return (f"| {step.tokens} | {step.images} | {step.wall_ms:.1f} | {step.encoder_ms:.1f} | "
            f"{step.forward_ms:.1f} | {step.other_ms:.1f} | {step.floor_ms:.1f} | "
            f"{step.ratio:.2f} |")  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="qwen2-vl-2b")
    parser.add_argument("--model-root", default="/tmp/tessera-models")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--prompt-len", type=int, default=200, help="words of text (~tokens)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="flashinfer")
    parser.add_argument("--profile-dir", default=None)
    parser.add_argument("--out", default=None, help="write the steps as JSON here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    steps, context = measure(args)
    print(f"{args.size}: {args.requests} requests of a {args.image_size}x{args.image_size} "
          f"image and {args.prompt_len} words at once, on {context['device']} "
          f"({context['gemm_tflops']:.3g} TFLOP/s in one large GEMM)")  # fmt: skip
    print("| tokens | images | wall ms | encoder ms | forward ms | other ms | floor ms | "
          "wall/floor |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for step in steps:
        print(format_row(step))
    total = PrefillStep(*(sum(getattr(s, field) for s in steps) for field in
                          ("tokens", "images", "wall_ms", "encoder_ms", "forward_ms",
                           "floor_ms")))  # fmt: skip
    print(format_row(total).replace("| ", "| all: ", 1))
    if args.out:
        rows = [{**asdict(s), "other_ms": s.other_ms, "ratio": s.ratio} for s in steps]
        Path(args.out).write_text(json.dumps({"context": context, "steps": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
