"""What structured outputs cost: constrained vs free decoding side by side. Not a test.

    PYTHONPATH=. python bench/structured_output.py --sizes tiny small --batch 1 8

Two parts, both printed as tables:

1. End to end, offline `LLM.generate`: B prompts decode --new-tokens tokens each, free
   (EOS ignored) and under the regex `[a-z ,.]*` with `min_tokens` = --new-tokens, so
   both runs produce the same number of tokens. The runs alternate,
   --repeat times, and each number is the best; the ratio is constrained / free tokens/s.
   The constrained run pays for llguidance's mask per row per step, the bitmask's
   copy and unpacking in the sampler, and (on a GPU) steps that cannot be launched ahead.
2. The sampler alone on [S, V] float32 logits of a Qwen2-VL-sized vocabulary (151936):
   `Sampler.sample` greedy without masks vs with every row masked (random bitmasks), in
   microseconds per call. This is Tessera's share of a mask; llguidance's share (computing
   the bitmask) depends on the tokenizer and the grammar, and the generated checkpoints'
   tokenizers are small (1.5k tokens), so part 1 understates it for a real vocabulary.
3. llguidance's share on a synthetic byte-level vocabulary of that size: building its view
   of the tokenizer, one JSON-schema matcher, the masks of a random walk through it, and
   the first mask of the hostile regex `a{1000000}` at llguidance's default lexer fuel
   and at Tessera's --grammar-lexer-fuel.
4. What compiling large schemas costs the requests already running: 8 plain requests
   decode 48 tokens while --schema-arrivals requests with a large schema (anyOf 20
   objects x 50 properties) arrive, one per step, each schema new or the same one each
   time; engine step times (add_request included) until the 8 are done. Compiled on the
   worker thread and cached (engine/grammar_admission.py), or on the engine loop for every
   request as before (patched in here), beside a run where none arrive.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engine import LLM, SamplingParams, StructuredOutput
from engine.config import EngineConfig
from engine.protocol import EngineRequest
from engine.sampler import Sampler, SamplingRow
from engine.structured_output import GrammarCompiler, parser_limits
from engine.tiny_model import make_tiny_model

QWEN_VOCAB = 151936
PROMPT = "Write a short story about the sea and a lighthouse keeper named"


def tokens_per_second(llm: LLM, batch: int, params: SamplingParams) -> float:
    prompts = [f"{PROMPT} {i}." for i in range(batch)]
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(r.error is None for r in results)
    return sum(len(r.token_ids) for r in results) / elapsed


def end_to_end(model_dir: Path, batches: list[int], new_tokens: int, repeat: int) -> None:
    free = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    regex = StructuredOutput(regex="[a-z ,.]*")
    # min_tokens holds EOS back (the grammar allows it at every point), so both runs make
    # new_tokens tokens per prompt.
    constrained = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0,
                                 structured_output=regex)  # fmt: skip
    with LLM(str(model_dir)) as llm:
        llm.generate([PROMPT], SamplingParams(max_tokens=4, structured_output=regex))  # warm-up
        for batch in batches:
            best = {"free": 0.0, "constrained": 0.0}
            for _ in range(repeat):
                for name, params in (("free", free), ("constrained", constrained)):
                    best[name] = max(best[name], tokens_per_second(llm, batch, params))
            ratio = best["constrained"] / best["free"]
            print(f"| {model_dir.name} | {batch} | {best['free']:.1f} | "
                  f"{best['constrained']:.1f} | {ratio:.2f}x |")  # fmt: skip


def sampler_micro(rows: list[int], iters: int) -> None:
    sampler = Sampler()
    generator = torch.Generator().manual_seed(0)
    words = (QWEN_VOCAB + 31) // 32
    for num_rows in rows:
        logits = torch.randn(num_rows, QWEN_VOCAB, generator=generator)
        masks = torch.randint(-(2**31), 2**31 - 1, (num_rows, words), dtype=torch.int32,
                              generator=generator)  # fmt: skip
        params = SamplingParams(temperature=0.0)
        free = [SamplingRow(params, [1], []) for _ in range(num_rows)]
        masked = [SamplingRow(params, [1], [], allowed_tokens=masks[i]) for i in range(num_rows)]
        timings = {}
        for name, batch in (("free", free), ("masked", masked)):
            sampler(logits, batch)  # warm-up
            start = time.perf_counter()
            for _ in range(iters):
                sampler(logits, batch)
            timings[name] = (time.perf_counter() - start) / iters * 1e6
        extra = timings["masked"] - timings["free"]
        print(f"| {num_rows} | {timings['free']:.0f} | {timings['masked']:.0f} | "
              f"{extra:.0f} | {extra / num_rows:.0f} |")  # fmt: skip


def synthetic_vocabulary_tokenizer(size: int, seed: int = 0) -> str:
    """tokenizer.json text of a byte-level BPE with `size` tokens: the 256 byte symbols plus
    random words over letters, digits and JSON punctuation (no merges: llguidance reads
    only each token's bytes). Stands in for a real 150k vocabulary, which no checkpoint
    here has."""
    rng = random.Random(seed)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<unk>": 0, **{symbol: i + 1 for i, symbol in enumerate(alphabet)}}
    letters = 'abcdefghijklmnopqrstuvwxyzĠABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}":,[]._-'
    while len(vocab) < size:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|im_end|>"])
    return tokenizer.to_str()


def llguidance_on_a_large_vocabulary(steps: int) -> None:
    """Times GrammarCompiler's parts on a synthetic 152k vocabulary: the tokenizer view
    (built once per engine, on a thread at start-up), one matcher, and `steps` masks of a
    JSON schema while random allowed tokens are consumed."""
    folder = Path(tempfile.mkdtemp(prefix="tessera-vocab-"))
    (folder / "tokenizer.json").write_text(synthetic_vocabulary_tokenizer(151646))
    compiler = GrammarCompiler(str(folder / "tokenizer.json"), QWEN_VOCAB, (151646,))
    start = time.perf_counter()
    compiler.warm()
    print(f"tokenizer view: {time.perf_counter() - start:.3f} s")
    schema = {"type": "object", "required": ["name", "age", "tags"], "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}}}  # fmt: skip
    start = time.perf_counter()
    matcher = compiler.matcher(StructuredOutput(json=json.dumps(schema)))
    print(f"one matcher: {(time.perf_counter() - start) * 1e3:.2f} ms")
    rng, times = random.Random(1), []
    for _ in range(steps):
        start = time.perf_counter()
        mask = matcher.allowed_tokens()
        times.append(time.perf_counter() - start)
        bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits)
        if matcher.is_complete or not len(allowed):
            break
        matcher.accept(int(rng.choice(allowed)))
    times.sort()
    print(f"{len(times)} masks: median {times[len(times) // 2] * 1e6:.0f} us, "
          f"p90 {times[len(times) * 9 // 10] * 1e6:.0f} us, max {times[-1] * 1e6:.0f} us")  # fmt: skip
    # A short hostile regex: what its first mask costs the engine loop at llguidance's
    # default lexer fuel and at Tessera's (--grammar-lexer-fuel).
    for fuel in (1_000_000, EngineConfig(model="").grammar_lexer_fuel):
        hostile = GrammarCompiler(str(folder / "tokenizer.json"), QWEN_VOCAB, (151646,),
                                  parser_limits(fuel))  # fmt: skip
        hostile.warm()
        matcher = hostile.matcher(StructuredOutput(regex="a{1000000}"))
        start = time.perf_counter()
        matcher.allowed_tokens()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        print(f"a{{1000000}} at lexer fuel {fuel}: first mask {elapsed_ms:.1f} ms")


def large_schema(tag: int) -> str:
    """anyOf 20 objects of 50 string properties; `tag` makes it a new grammar."""
    objects = [
        {"type": "object", "additionalProperties": False,
         "properties": {f"p{tag}_{i}_{j}": {"type": "string"} for j in range(50)}}
        for i in range(20)
    ]  # fmt: skip
    return json.dumps({"anyOf": objects})


def compile_on_the_loop(engine) -> None:
    """Tessera before engine/grammar_admission.py: every request's grammar compiled inside
    add_request (a copy of the engine's compiler, sharing its tokenizer view, uncached)."""
    compiler = copy.copy(engine._grammar_compiler())
    compiler._cache_size = 0

    def submit(request, media) -> bool:
        spec = request.sampling.structured_output
        if spec is not None:
            request.grammar = compiler.matcher(spec)
        return False

    engine.grammars.submit = submit


def decode_beside_arrivals(llm: LLM, arrivals: int, tag: int, new: bool) -> list[float]:
    """Seconds per engine step (add_request included) until 8 plain requests have decoded
    48 tokens, while `arrivals` requests with a large schema arrive, one per step: each a
    new schema (`new`), or the same one every time. Then runs the rest to the end."""
    engine, tokenizer = llm.engine, llm.prompt_processor.tokenizer
    plain = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompt = tokenizer.encode(PROMPT).ids
    running = {f"plain-{tag}-{i}" for i in range(8)}
    for i, request_id in enumerate(sorted(running)):
        engine.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt + [i],
                                         sampling=plain))  # fmt: skip
    times, added = [], 0
    while running:
        start = time.perf_counter()
        if added < arrivals:
            spec = StructuredOutput(json=large_schema(tag + added if new else tag))
            sampling = SamplingParams(max_tokens=1, structured_output=spec)
            engine.add_request(EngineRequest(request_id=f"schema-{tag}-{added}",
                                             prompt_token_ids=prompt, sampling=sampling))  # fmt: skip
            added += 1
        outputs = engine.step().outputs
        times.append(time.perf_counter() - start)
        running -= {o.request_id for o in outputs if o.finish_reason is not None}
    while engine.has_unfinished_requests():
        engine.step()
    return times


def compile_stall(model_dir: Path, arrivals: int) -> None:
    with LLM(str(model_dir)) as llm:
        compiler = llm.engine._grammar_compiler()
        compiler.warm()
        start = time.perf_counter()
        compiler.matcher(StructuredOutput(json=large_schema(-1)))
        print(f"one large schema compiled: {(time.perf_counter() - start) * 1e3:.1f} ms")
        decode_beside_arrivals(llm, 0, 0, new=False)  # warm-up
        print("| schemas arriving | compiled | 8 requests' 48 steps, ms | median step ms | "
              "p90 ms | max ms |")  # fmt: skip
        print("|---|---|---:|---:|---:|---:|")
        runs = [("none", "-", 0, True), ("new each time", "worker thread", arrivals, True),
                ("the same one", "worker thread, then cached", arrivals, False),
                ("new each time", "engine loop (old)", arrivals, True),
                ("the same one", "engine loop, every time (old)", arrivals, False)]  # fmt: skip
        for i, (arriving, where, count, new) in enumerate(runs):
            if where.startswith("engine loop") and i == 3:
                compile_on_the_loop(llm.engine)
            times = decode_beside_arrivals(llm, count, 1000 * (i + 1), new)
            ordered = sorted(times)
            median, p90 = ordered[len(ordered) // 2], ordered[len(ordered) * 9 // 10]
            print(f"| {arriving} | {where} | {sum(times) * 1e3:.0f} | {median * 1e3:.1f} | "
                  f"{p90 * 1e3:.1f} | {ordered[-1] * 1e3:.1f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sampler-rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--sampler-iters", type=int, default=20)
    parser.add_argument("--mask-steps", type=int, default=200)
    parser.add_argument("--schema-arrivals", type=int, default=24)
    parser.add_argument("--model-root", type=Path, default=None)
    args = parser.parse_args()
    root = args.model_root or Path(tempfile.mkdtemp(prefix="tessera-structured-"))
    print("| model | batch | free tok/s | constrained tok/s | constrained / free |")
    print("|---|---:|---:|---:|---:|")
    for size in args.sizes:
        model_dir = root / size
        if not (model_dir / "config.json").exists():
            make_tiny_model(model_dir, size=size)
        end_to_end(model_dir, args.batch, args.new_tokens, args.repeat)
    print(f"\nSampler, greedy, [S, {QWEN_VOCAB}] float32 logits (microseconds per call)")
    print("| rows S | no masks | every row masked | extra | extra per row |")
    print("|---:|---:|---:|---:|---:|")
    sampler_micro(args.sampler_rows, args.sampler_iters)
    print(f"\nllguidance on a synthetic {QWEN_VOCAB}-token vocabulary")
    llguidance_on_a_large_vocabulary(args.mask_steps)
    print(f"\nLarge schemas arriving while 8 requests decode ({args.sizes[0]} model)")
    compile_stall(root / args.sizes[0], args.schema_arrivals)


if __name__ == "__main__":
    main()
