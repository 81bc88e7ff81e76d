"""Benchmark (not a test): one sampling step of the engine's sampler, by sampling settings.

    PYTHONPATH=. .venv/bin/python bench/sampler.py                 # 32 rows x 151,936, CPU
    cd /tmp/old && PYTHONPATH=. python /work/main/bench/sampler.py  # another checkout's sampler
    PYTHONPATH=. python bench/sampler.py --device cuda --rows 128   # on a GPU

Times `Sampler.sample(...).result()` on random bf16 logits (as a bf16 model hands them
over) for --rows rows, all with the same settings, for each preset below. The presets are
what requests ask for in practice: checkpoints' generation_config.json defaults reach every
request that leaves the fields out (`--generation-config auto`, as vLLM).

  greedy            temperature 0
  qwen2-vl          Qwen2-VL-Instruct's defaults: top_k 1, top_p 0.001, temperature 0.01,
                    repetition_penalty 1.05 (--prompt-len prompt tokens, 64 outputs each)
  qwen3-vl          Qwen3-VL-Instruct's: top_k 20, top_p 0.8, temperature 0.7
  temperature       temperature 0.7 alone (the whole vocabulary is raced)
  seeded            temperature 0.7 with a seed per row
  qwen3-vl-seeded   Qwen3-VL-Instruct's defaults with a seed per row
  qwen3-vl-one-seeded  the same with a seed on the first row only (one client that sets
                    seeds among many that do not)
  openai-penalties  greedy with OpenAI's presence_penalty 0.5 and frequency_penalty 0.5
                    (64 outputs each)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from engine.protocol import SamplingParams
from engine.request import Request, RequestStatus
from engine.sampler import Sampler, SamplingRow

PRESETS = {
    "greedy": {"temperature": 0.0},
    "qwen2-vl": {"top_k": 1, "top_p": 0.001, "temperature": 0.01, "repetition_penalty": 1.05},
    "qwen3-vl": {"top_k": 20, "top_p": 0.8, "temperature": 0.7},
    "temperature": {"temperature": 0.7},
    "seeded": {"temperature": 0.7, "seed": 0},
    "qwen3-vl-seeded": {"top_k": 20, "top_p": 0.8, "temperature": 0.7, "seed": 0},
    "qwen3-vl-one-seeded": {"top_k": 20, "top_p": 0.8, "temperature": 0.7, "seed": 0},
    "openai-penalties": {"temperature": 0.0, "presence_penalty": 0.5, "frequency_penalty": 0.5},
}


def make_rows(preset: str, args: argparse.Namespace, device: torch.device) -> list[SamplingRow]:
    rows = []
    for index in range(args.rows):
        settings = dict(PRESETS[preset])
        if "seed" in settings:
            settings["seed"] = index if index == 0 or preset != "qwen3-vl-one-seeded" else None
        params = SamplingParams(**settings)
        prompt = [(index * 7 + j) % args.vocab for j in range(args.prompt_len)]
        outputs = [(index * 11 + j) % args.vocab for j in range(64)]
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        request = None
        if params.has_penalties:  # as the engine hands them over: with its request, whose
            request = Request(f"r{index}", prompt, params)  # ids the sampler's table keeps
            request.output_token_ids = outputs
            request.status = RequestStatus.RUNNING
            request.num_pending_tokens = 1  # the token this step samples
        rows.append(SamplingRow(params, prompt, outputs, generator, request=request))
    return rows


def time_preset(preset: str, args: argparse.Namespace) -> float:
    """Median milliseconds of one sampling step over --repeats."""
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=generator) * 3).bfloat16().to(device)
    rows = make_rows(preset, args, device)
    sampler = Sampler(seed=0)
    times = []
    for repeat in range(args.repeats + 1):  # the first is a warm-up
        started = time.perf_counter()
        token_ids = sampler.sample(logits, rows).result().token_ids
        if repeat:
            times.append((time.perf_counter() - started) * 1000)
        for row, token_id in zip(rows, token_ids, strict=True):  # the scheduler's update
            if row.request is not None:
                row.request.output_token_ids.append(token_id)
    return sorted(times)[len(times) // 2]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--presets", nargs="+", choices=list(PRESETS), default=list(PRESETS))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{args.rows} rows x {args.vocab} logits on {args.device} ({args.threads} threads):")
    for preset in args.presets:
        print(f"  {preset:16s} {time_preset(preset, args):9.2f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
