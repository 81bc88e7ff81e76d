"""Benchmark (not a test): the engine's host-side work per decode step, by phase.

    PYTHONPATH=. python bench/engine_host.py --batch 128 --prompt-len 450
    PYTHONPATH=. python bench/engine_host.py --repetition-penalty 1.05   # with penalties
    PYTHONPATH=. python bench/engine_host.py --presence-penalty 0.5 --frequency-penalty 0.5
    PYTHONPATH=. python bench/engine_host.py --admit-images 128   # and admitting images

On a GPU the device runs a 2B decode step at batch 128 in ~3.2 ms (docs/gpu.md); with
overlap scheduling the host prepares the next step meanwhile, so the host work per step
must stay below that. This runs `EngineCore.step()` on the tiny generated checkpoint
(CPU, one thread) with --batch requests of --prompt-len tokens, lets prefill finish,
then times --steps decode steps and, inside them, the host phases below (wall time of
each call, summed per step). `forward` is the model on CPU here, not host overhead;
what is left after the named phases is sampling, outputs and the step's bookkeeping.

  schedule        Scheduler.schedule (which calls allocate_slots for every request)
  allocate_slots  KVCacheManager.allocate_slots (block accounting, prefix-cache hashes)
  gather          step_inputs.gather_step_inputs (the flat batch on the host)
  forward         ModelRunner._forward (the model)
  update          Scheduler.update (tokens in, finished requests out)
  host            step - forward: all the host work of a step (on CPU this includes the
                  torch attention backend's plan, which FlashInfer's plan replaces on a GPU)

With --admit-images N it also times `EngineCore.add_request` for N requests of a distinct
448x448 image and 200 words each (built as the API process builds them, before the
clock): what a burst of image requests costs the engine loop before its next launch.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

import engine.model_runner as model_runner
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_cache_manager import KVCacheManager
from engine.protocol import EngineRequest, SamplingParams
from engine.scheduler import Scheduler


@contextlib.contextmanager
def timed(owner: object, name: str, label: str, totals: Counter) -> Iterator[None]:
    """While active, `owner.name` adds each call's wall time to totals[label]."""
    original: Callable = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


PHASES = [  # (owner, attribute, label)
    (Scheduler, "schedule", "schedule"),
    (KVCacheManager, "allocate_slots", "allocate_slots"),
    (model_runner, "gather_step_inputs", "gather"),
    (model_runner.ModelRunner, "_forward", "forward"),
    (Scheduler, "update", "update"),
]


def measure(model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    totals: Counter = Counter()
    with contextlib.ExitStack() as stack:
        for owner, name, label in PHASES:
            stack.enter_context(timed(owner, name, label, totals))
        return _run(model_dir, args, totals)


def _run(model_dir: Path, args: argparse.Namespace, totals: Counter) -> dict[str, float]:
    core = EngineCore(
        EngineConfig(model=str(model_dir), num_kv_blocks=args.num_kv_blocks, max_model_len=4096)
    )
    sampling = SamplingParams(max_tokens=args.steps + 64, ignore_eos=True, temperature=0.0,
                              repetition_penalty=args.repetition_penalty,
                              presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty)  # fmt: skip
    for i in range(args.batch):
        prompt = [(i * 7 + j) % 1000 + 10 for j in range(args.prompt_len)]
        core.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                       sampling=sampling))  # fmt: skip
    while any(not r.output_token_ids for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()  # prefill (and the first token) of every request
    totals.clear()
    start = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    per_step = {label: 1000 * seconds / args.steps for label, seconds in totals.items()}
    per_step["step"] = 1000 * (time.perf_counter() - start) / args.steps
    return per_step


def admission_ms(model_dir: Path, num_images: int) -> float:
    """Milliseconds of `EngineCore.add_request` per image request (see the docstring)."""
    from bench.datasets import image_chat_prompt, random_text
    from engine import LLM
    from engine.llm_params import SamplingParams as LLMSamplingParams  # what _build_request takes

    llm = LLM(str(model_dir), num_kv_blocks=num_images * 64, max_num_seqs=num_images)
    rng, requests = random.Random(0), []
    for index in range(num_images):
        prompt = image_chat_prompt(index, 448, random_text(rng, 200))
        requests.append(llm._build_request(f"i{index}", prompt, LLMSamplingParams(max_tokens=1)))
    start = time.perf_counter()
    for request, tensors, _ in requests:
        llm.engine.add_request(request, tensors)
    return (time.perf_counter() - start) / num_images * 1000


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=450)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--num-kv-blocks", type=int, default=8192)
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="1.05: what Qwen2-VL checkpoints ask for (the sampler then "
                             "reads every prompt and output)")  # fmt: skip
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="OpenAI's (the sampler then reads every output)")  # fmt: skip
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--admit-images", type=int, default=0,
                        help="also time add_request of this many image requests")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.tiny_model import make_tiny_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host phases, not the CPU model, are the subject
    try:
        with tempfile.TemporaryDirectory(prefix="tessera-engine-host-") as tmp:
            model_dir = make_tiny_model(Path(tmp) / "tiny")
            per_step = measure(model_dir, args)
            admit_ms = admission_ms(model_dir, args.admit_images) if args.admit_images else None
    finally:
        torch.set_num_threads(threads)
    print(f"batch {args.batch}, prompt {args.prompt_len} tokens, {args.steps} decode steps, "
          f"repetition_penalty {args.repetition_penalty}, presence_penalty "
          f"{args.presence_penalty}, frequency_penalty {args.frequency_penalty}:")  # fmt: skip
    per_step["host"] = per_step["step"] - per_step.get("forward", 0.0)
    for label in ("step", "forward", "host", "schedule", "allocate_slots", "gather", "update"):
        print(f"  {label:15s} {per_step.get(label, 0.0):8.3f} ms/step")
    if admit_ms is not None:
        print(f"add_request of {args.admit_images} image requests: {admit_ms:.3f} ms each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
