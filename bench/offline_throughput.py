"""Offline generation throughput: Tessera's LLM vs transformers generate(). Not a test.

    PYTHONPATH=. python bench/offline_throughput.py --sizes tiny small --concurrency 1 8 32

For each checkpoint size (generated with engine.tiny_model unless --model-dir is
given) and each concurrency N, N text prompts of --prompt-len tokens produce
--new-tokens tokens each (EOS ignored; both default per size, see WORKLOADS, so that
`--sizes tiny small` stays within minutes on a 2-core CPU), with:
    tessera        all N submitted together to LLM.generate (continuous batching)
    hf-sequential  transformers generate(), one prompt at a time (batch 1)
    hf-padded      transformers generate() on the N prompts as one left-padded batch
and a table of generated tokens per second is printed, with our ratio to each. All
three run in the same process on the same prompts; with --repeat R each number is the
best of R runs (a shared machine is noisy; compare ratios, not absolute numbers).
When other jobs share the cores, pass --threads 1: torch's default of one thread per
core stalls at every op barrier on an oversubscribed machine and the numbers become noise.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.tiny_model import make_tiny_model

# size -> (prompt_len, new_tokens, max_sequential) unless given on the command line.
WORKLOADS = {"tiny": (64, 64, 8), "tiny2": (64, 64, 8), "small": (32, 32, 2)}


def make_prompts(count: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [
        max(4, prompt_len + rng.randint(-prompt_len // 4, prompt_len // 4)) for _ in range(count)
    ]
    return [[rng.randrange(10, vocab - 10) for _ in range(n)] for n in lengths]


def bench_tessera(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed


def hf_generate(model, batch: list[list[int]], new_tokens: int, pad_id: int) -> int:
    width = max(len(p) for p in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):  # left padding
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    device = model.device
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return (out.shape[1] - width) * len(batch)


def bench_hf(
    model, prompts, new_tokens: int, pad_id: int, *, padded: bool, max_sequential: int
) -> float:
    hf_generate(model, prompts[:1], 2, pad_id)  # warm-up
    start = time.perf_counter()
    if padded:
        generated = hf_generate(model, prompts, new_tokens, pad_id)
    else:  # batch 1; sample at most max_sequential prompts (rate is per prompt anyway)
        generated = sum(
            hf_generate(model, [p], new_tokens, pad_id) for p in prompts[:max_sequential]
        )
    return generated / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny"])
    parser.add_argument("--model-dir", help="use this checkpoint instead of generating one")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, help="default: per size (WORKLOADS)")
    parser.add_argument("--new-tokens", type=int, help="default: per size (WORKLOADS)")
    parser.add_argument("--max-sequential", type=int, help="default: per size (WORKLOADS)")
    parser.add_argument("--repeat", type=int, default=1, help="best of R runs per number")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers  # the oracle, imported only here

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            default_prompt, default_new, default_sequential = WORKLOADS.get(size, (64, 64, 8))
            prompt_len = args.prompt_len or default_prompt
            new_tokens = args.new_tokens or default_new
            max_sequential = args.max_sequential or default_sequential
            model_dir = (
                Path(args.model_dir)
                if args.model_dir
                else make_tiny_model(Path(tmp) / size, seed=0, size=size)
            )
            llm = LLM(
                str(model_dir),
                device=args.device,
                dtype=args.dtype,
                max_num_seqs=max(args.concurrency),
                enable_prefix_caching=False,
            )
            device, dtype = llm.engine.runner.device, llm.engine.runner.dtype
            vocab = llm.engine.model_config.vocab_size
            hf = None
            if not args.skip_hf:
                hf = (
                    transformers.AutoModelForImageTextToText.from_pretrained(
                        model_dir, dtype=dtype
                    )
                    .to(device)
                    .eval()
                )
                hf.generation_config.eos_token_id = None
            for concurrency in args.concurrency:
                prompts = make_prompts(concurrency, prompt_len, vocab, seed=concurrency)
                ours = max(bench_tessera(llm, prompts, new_tokens) for _ in range(args.repeat))
                sequential = padded = float("nan")
                if hf is not None:
                    sequential = max(
                        bench_hf(
                            hf, prompts, new_tokens, 0, padded=False, max_sequential=max_sequential
                        )
                        for _ in range(args.repeat)
                    )
                    padded = max(
                        bench_hf(
                            hf, prompts, new_tokens, 0, padded=True, max_sequential=max_sequential
                        )
                        for _ in range(args.repeat)
                    )
                dtype_name = str(dtype).removeprefix("torch.")
                rows.append(
                    (
                        size,
                        dtype_name,
                        concurrency,
                        prompt_len,
                        new_tokens,
                        ours,
                        sequential,
                        padded,
                    )
                )
                print(
                    f"{size:>6} N={concurrency:<3} tessera {ours:9.1f} tok/s  "
                    f"hf-seq {sequential:9.1f}  hf-padded {padded:9.1f}",
                    flush=True,
                )
            del llm, hf
    print(f"\ndevice={device} threads={torch.get_num_threads()}")
    print(
        f"{'size':>6} {'dtype':>8} {'N':>4} {'prompt':>6} {'new':>4} {'tessera':>10} {'hf-seq':>10} "
        f"{'hf-padded':>10} {'x seq':>7} {'x padded':>9}"
    )
    for size, dtype_name, n, prompt_len, new_tokens, ours, seq, padded in rows:
        print(
            f"{size:>6} {dtype_name:>8} {n:>4} {prompt_len:>6} {new_tokens:>4} {ours:>10.1f} {seq:>10.1f} "
            f"{padded:>10.1f} {ours / seq:>7.2f} {ours / padded:>9.2f}"
        )


if __name__ == "__main__":
    main()
