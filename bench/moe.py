"""Times one mixture-of-experts layer's experts: transformers' loop against the grouped
matmuls (engine/models/moe.py), at Qwen3-30B-A3B's widths by default.

    PYTHONPATH=. .venv/bin/python bench/moe.py [--tokens 8 64] [--device cpu]

Prints ms per call for each token count and dtype, and the largest difference between
the two (float32: none or rounding, e.g. 2e-6 at 64 tokens of hidden 2048).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from engine.model_config import MoEConfig
from engine.models.moe import MoEExperts


def timed(run, repeat: int, device: torch.device) -> float:
    for _ in range(2):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768, help="moe_intermediate_size")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = MoEConfig(args.experts, args.top_k, args.width, True, (0,))
    generator = torch.Generator().manual_seed(0)
    print("| dtype | tokens | loop ms | grouped ms | ratio | max diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        experts = MoEExperts(args.hidden, config).to(device=device, dtype=dtype)
        with torch.no_grad():
            for param in experts.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * args.hidden**-0.5)
            for num_tokens in args.tokens:
                x = torch.randn(num_tokens, args.hidden, generator=generator).to(device, dtype)
                picks = torch.stack([torch.randperm(args.experts, generator=generator)[: args.top_k]
                                     for _ in range(num_tokens)]).to(device)  # fmt: skip
                weights = torch.rand(num_tokens, args.top_k, generator=generator).to(device, dtype)
                inputs = (x, picks, weights)
                loop = timed(functools.partial(experts.loop, *inputs), args.repeat, device)
                grouped = timed(functools.partial(experts.grouped, *inputs), args.repeat, device)
                diff = experts.loop(*inputs) - experts.grouped(*inputs)
                print(f"| {name} | {num_tokens} | {loop:.1f} | {grouped:.1f} | "
                      f"{grouped / loop:.2f} | {diff.abs().max().item():.3g} |")  # fmt: skip


if __name__ == "__main__":
    main()
