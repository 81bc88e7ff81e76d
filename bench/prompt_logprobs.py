"""What scoring a prompt costs (`prompt_logprobs`, and `echo` with `logprobs`). Not a test.

    PYTHONPATH=. python bench/prompt_logprobs.py --sizes tiny small --prompt-len 512

For each checkpoint size, --batch prompts of --prompt-len tokens each are prefilled and
give one token (`max_tokens=1`, so the run is nearly all prefill) through the offline
`LLM`: plainly, then with `prompt_logprobs` 0 and 5. The runs alternate, --repeat times,
and each number is the best. The extra time is the scoring: one [rows, vocab] logits
matmul per 256-row slice, its log-softmax, rank and top-k (engine/prompt_logprobs.py);
the scored runs also skip the prefix cache, which the prompts here never hit.

The generated `tiny` and `small` checkpoints have small vocabularies (1.6k, 8k), and the
scoring grows with the vocabulary, so the script then times the scorer alone on Qwen2-VL-2B's
shapes (hidden 1536, vocab 151936, float32): --prompt-len rows of random hidden states
through a random lm_head, scored with k=5.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.model_config import ModelConfig
from engine.prompt_logprobs import score_prompt_tokens
from engine.tiny_model import make_tiny_model

TEXT = "The harbour master counted the ships, the gulls and the waves of the grey sea. "


def make_prompts(llm: LLM, count: int, prompt_len: int) -> list[list[int]]:
    """`count` distinct text prompts of `prompt_len` tokens (text, so that no id is a
    media placeholder)."""
    tokenizer = llm.prompt_processor.tokenizer
    prompts = []
    for i in range(count):
        ids = tokenizer.encode(f"Report {i}. " + TEXT * (prompt_len // 8 + 1)).ids
        prompts.append(ids[:prompt_len])
    return prompts


def seconds(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(result.error is None for result in results)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny"])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model-root", type=Path, default=None)
    args = parser.parse_args()
    root = args.model_root or Path(tempfile.mkdtemp(prefix="tessera-prompt-logprobs-"))
    print("| model | vocab | prompt tokens | plain s | prompt_logprobs=0 s | =5 s | extra per "
          "1k prompt tokens (k=5) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        model_dir = root / size
        if not (model_dir / "config.json").exists():
            make_tiny_model(model_dir, size=size)
        vocab = ModelConfig.from_model_dir(model_dir).vocab_size
        runs = {
            "plain": SamplingParams(max_tokens=1, temperature=0.0),
            "k0": SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
            "k5": SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5),
        }
        best = dict.fromkeys(runs, float("inf"))
        with LLM(str(model_dir), enable_prefix_caching=False) as llm:
            prompts = make_prompts(llm, args.batch, args.prompt_len)
            seconds(llm, prompts[:1], runs["k5"])  # warm-up
            for _ in range(args.repeat):
                for name, params in runs.items():
                    best[name] = min(best[name], seconds(llm, prompts, params))
        num_tokens = sum(len(prompt) for prompt in prompts)
        extra = (best["k5"] - best["plain"]) / num_tokens * 1000
        print(f"| {size} | {vocab} | {num_tokens} | {best['plain']:.3f} | {best['k0']:.3f} | "
              f"{best['k5']:.3f} | {extra:.3f} s |")  # fmt: skip
    scorer_alone(args.prompt_len, repeat=args.repeat)


def scorer_alone(rows: int, hidden_size: int = 1536, vocab: int = 151936, repeat: int = 3) -> None:
    generator = torch.Generator().manual_seed(0)
    lm_head = torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5
    hidden = torch.randn(rows, hidden_size, generator=generator)
    token_ids = torch.randint(0, vocab, (rows + 1,), generator=generator).tolist()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        score_prompt_tokens("bench", hidden, 0, token_ids, 5, lambda h: h @ lm_head.T).entries()
        best = min(best, time.perf_counter() - start)
    print(f"\nscorer alone, hidden {hidden_size}, vocab {vocab}: {rows} rows in {best:.3f} s "
          f"({best / rows * 1000:.3f} s per 1k prompt tokens)")  # fmt: skip


if __name__ == "__main__":
    main()
