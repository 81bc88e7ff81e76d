"""Tensor parallelism on CPU: generation throughput with the decoder split over 1 or 2 ranks.
Not a test.

    PYTHONPATH=. python bench/tensor_parallel.py --sizes tiny small --concurrency 1 8

For each checkpoint size and concurrency N, N text prompts generate a fixed number of
tokens (EOS ignored) through `LLM` with `tensor_parallel_size` 1 and 2, in the same
process, alternating, best of --repeat runs. Each rank runs --threads-per-rank torch
threads; the one-rank run is also measured with `ranks x threads-per-rank` threads, the
same cores as the split run. Prints tokens/s and the split run's ratio to each. Two
all-reduces of [T, hidden] per layer go through gloo over loopback TCP, so on a small
machine the split run pays more in collectives than it saves in compute; the script
shows how much, and first times one all-reduce of a decode row by itself.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench.offline_throughput import WORKLOADS, bench_tessera, make_prompts
from engine import LLM
from engine.model_config import ModelConfig
from engine.tiny_model import make_tiny_model


def all_reduce_seconds(hidden: int, rows: int = 1, iters: int = 500) -> float:
    """Seconds per gloo all-reduce of [rows, hidden] float32 between two ranks on this
    host (two threads of this process; gloo waits without holding the GIL)."""
    results: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = f"{tmp}/store"

        def rank(r: int) -> None:
            group = dist.ProcessGroupGloo(dist.FileStore(store, 2), r, 2, timedelta(seconds=60))
            x = torch.zeros(rows, hidden)
            group.allreduce(x).wait()  # connect
            start = time.perf_counter()
            for _ in range(iters):
                group.allreduce(x).wait()
            results.append((time.perf_counter() - start) / iters)

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return max(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=2, help="best of R runs per number")
    args = parser.parse_args()
    ranks = 2
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            model_dir = str(make_tiny_model(Path(tmp) / size, size=size))
            model_config = ModelConfig.from_model_dir(model_dir)
            vocab, hidden = model_config.vocab_size, model_config.hidden_size
            prompt_len, new_tokens, _ = WORKLOADS.get(size, (32, 32, 2))
            runs = {
                f"1 rank x {args.threads_per_rank}": (1, args.threads_per_rank),
                f"1 rank x {ranks * args.threads_per_rank}": (1, ranks * args.threads_per_rank),
                f"{ranks} ranks x {args.threads_per_rank}": (ranks, args.threads_per_rank),
            }
            llms = {
                name: LLM(model_dir, tensor_parallel_size=tp, num_threads=threads)
                for name, (tp, threads) in runs.items()
            }
            print(f"\n{size}: prompts of ~{prompt_len} tokens, {new_tokens} new tokens each")
            print(f"gloo all-reduce of [1, {hidden}]: {all_reduce_seconds(hidden) * 1e3:.3f} ms")
            print(f"{'N':>4} " + " ".join(f"{name:>14}" for name in runs) + "  split / others")
            for n in args.concurrency:
                prompts = make_prompts(n, prompt_len, vocab, seed=n)
                best = dict.fromkeys(runs, 0.0)
                for _ in range(args.repeat):
                    for name, llm in llms.items():
                        torch.set_num_threads(runs[name][1])  # rank 0 shares this process
                        best[name] = max(best[name], bench_tessera(llm, prompts, new_tokens))
                split = best[f"{ranks} ranks x {args.threads_per_rank}"]
                ratios = " ".join(
                    f"{split / rate:.2f}x" for name, rate in best.items() if rate != split
                )
                cells = " ".join(f"{best[name]:>10.1f} t/s" for name in runs)
                print(f"{n:>4} {cells}  {ratios}")
            for llm in llms.values():
                llm.close()


if __name__ == "__main__":
    main()
