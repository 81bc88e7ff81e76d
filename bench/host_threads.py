"""Benchmark (not a test): a step's host tensor work on 1 and on N intra-op threads, with
and without other processes keeping cores busy.

    PYTHONPATH=. .venv/bin/python bench/host_threads.py                 # 1 vs 2 threads
    PYTHONPATH=. python bench/host_threads.py --threads 1 16 --busy 8   # a GPU host

Why `engine.process.set_intra_op_threads` gives the engine one thread on a GPU: its host
tensor work is small (here: the repetition penalty's ids for 128 rows of a 500-token
prompt and 64 outputs, ~70k ids: a cat, two repeat_interleave, an add, as the sampler
built them each step before engine/held_tokens.py), and a parallel region waits for its
slowest thread. With --busy processes spinning beside it, as
the API process, image decoding and load clients do on a serving host, one descheduled
thread stalls the whole region. Prints the mean and p90 microseconds of the work per
thread count, quiet and busy.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from collections.abc import Sequence

import torch

VOCAB = 151936


def penalty_indices(pieces: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What `_apply_repetition_penalty` (engine/penalties.py) built on the host each step
    (it still does for rows without a request: tests, benchmarks)."""
    lengths = torch.tensor([len(piece) for piece in pieces])
    row_starts = torch.arange(len(pieces)) // 2 * VOCAB
    index = torch.cat(pieces) + row_starts.repeat_interleave(lengths)
    factors = torch.full((len(pieces),), 1.05).repeat_interleave(lengths)
    return index, factors


def time_work(threads: int, repeats: int) -> tuple[float, float]:
    """(mean, p90) microseconds of `penalty_indices` on `threads` intra-op threads."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    pieces = [torch.randint(0, VOCAB, (500 if i % 2 == 0 else 64,), generator=generator)
              for i in range(256)]  # fmt: skip
    for _ in range(20):
        penalty_indices(pieces)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        penalty_indices(pieces)
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.fmean(times), sorted(times)[int(0.9 * len(times))]


def spin(stop: multiprocessing.synchronize.Event) -> None:
    while not stop.is_set():
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--busy", type=int, default=1, help="spinning processes beside it")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args(argv)
    for label, busy in (("quiet", 0), (f"{args.busy} busy", args.busy)):
        stop = multiprocessing.Event()
        spinners = [multiprocessing.Process(target=spin, args=(stop,)) for _ in range(busy)]
        for process in spinners:
            process.start()
        try:
            for threads in args.threads:
                mean, p90 = time_work(threads, args.repeats)
                print(f"{label:>8}, {threads:2d} threads: mean {mean:7.0f} us, p90 {p90:7.0f} us")
        finally:
            stop.set()
            for process in spinners:
                process.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
