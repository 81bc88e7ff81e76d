"""Times the matmuls of one 0.5B-shaped decoder layer: `F.linear` vs oneDNN-prepacked.

    PYTHONPATH=. .venv/bin/python bench/cpu_linear.py [--threads 2]

Prints ms per layer at several row counts (decode batch sizes) and the ratio, and checks
the two give bit-identical results (see engine/models/cpu_prepack.py).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.cpu_prepack import PrepackedLinear

# (out, in) of qkv_proj, o_proj, gate_up_proj, down_proj at hidden 896, intermediate 4864.
LAYER_SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]


def time_layer(linears: list, inputs: dict[int, torch.Tensor], repeat: int) -> float:
    def run() -> None:
        for linear in linears:
            linear(inputs[linear.in_features])

    for _ in range(3):
        run()
    start = time.perf_counter()
    for _ in range(repeat):
        run()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with torch.inference_mode():
        plain = [nn.Linear(i, o, bias=False, dtype=torch.bfloat16) for o, i in LAYER_SHAPES]
        packed = [PrepackedLinear(linear) for linear in plain]
        print(f"{'rows':>5} {'F.linear ms':>12} {'prepacked ms':>13} {'ratio':>6} identical")
        for rows in args.rows:
            inputs = {i: torch.randn(rows, i, dtype=torch.bfloat16) for _, i in LAYER_SHAPES}
            same = all(
                torch.equal(
                    fast(inputs[fast.in_features]), F.linear(inputs[ref.in_features], ref.weight)
                )
                for ref, fast in zip(plain, packed, strict=True)
            )
            t_plain = time_layer(plain, inputs, args.repeat)
            t_packed = time_layer(packed, inputs, args.repeat)
            print(
                f"{rows:>5} {t_plain * 1e3:>12.2f} {t_packed * 1e3:>13.2f} "
                f"{t_plain / t_packed:>6.2f} {same}"
            )


if __name__ == "__main__":
    main()
