"""Interactive requests behind a batch backlog, first-come-first-served against
`--scheduling-policy priority`. Not a test.

    PYTHONPATH=. python bench/priority.py --size tiny --background 32 --interactive 8

The engine runs offline (`EngineCore` stepped in this process, `max_num_seqs` seats):
--background long requests (priority 10, --background-tokens each) are queued at once;
after --warmup-steps steps, one short interactive request (priority 0,
--interactive-tokens) arrives every --every steps. For both policies the script prints
each class's time to first token and to completion (median and max, wall-clock seconds
from its arrival) and the whole run's time, so the cost to the backlog shows beside the
gain of the interactive requests.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from engine import LLM, SamplingParams
from engine.protocol import EngineRequest
from engine.tiny_model import make_tiny_model

PROMPT = "Write a long report about the harbour, the ships and the weather of"


def run(llm: LLM, args: argparse.Namespace, policy: str) -> dict[str, list[tuple[float, float]]]:
    """(seconds to first token, seconds to finish) per request, by class. Under fcfs every
    request has priority 0 (the policy refuses others)."""
    engine, tokenizer = llm.engine, llm.prompt_processor.tokenizer
    ids = tokenizer.encode(PROMPT).ids

    def request(name: str, i: int, tokens: int, priority: int) -> EngineRequest:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        priority = priority if policy == "priority" else 0
        return EngineRequest(request_id=f"{policy}-{name}-{i}", prompt_token_ids=ids + [i],
                             sampling=params, priority=priority)  # fmt: skip

    arrived, first, done = {}, {}, {}
    pending = [request("interactive", i, args.interactive_tokens, 0)
               for i in range(args.interactive)]  # fmt: skip
    for i in range(args.background):
        background = request("background", i, args.background_tokens, 10)
        engine.add_request(background)
        arrived[background.request_id] = time.perf_counter()
    start, step = time.perf_counter(), 0
    while engine.has_unfinished_requests() or pending:
        if pending and step >= args.warmup_steps and (step - args.warmup_steps) % args.every == 0:
            interactive = pending.pop(0)
            engine.add_request(interactive)
            arrived[interactive.request_id] = time.perf_counter()
        for output in engine.step().outputs:
            now = time.perf_counter()
            if output.new_token_ids:
                first.setdefault(output.request_id, now)
            if output.finish_reason is not None:
                assert output.error is None, output.error
                done[output.request_id] = now
        step += 1
    total = time.perf_counter() - start
    times: dict[str, list[tuple[float, float]]] = {"background": [], "interactive": []}
    for request_id, at in arrived.items():
        kind = request_id.split("-")[1]
        times[kind].append((first[request_id] - at, done[request_id] - at))
    times["total"] = [(total, total)]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--background", type=int, default=32)
    parser.add_argument("--background-tokens", type=int, default=96)
    parser.add_argument("--interactive", type=int, default=8)
    parser.add_argument("--interactive-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--model-root", type=Path, default=None)
    args = parser.parse_args()
    root = args.model_root or Path(tempfile.mkdtemp(prefix="tessera-priority-"))
    model_dir = root / args.size
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, size=args.size)
    print("| policy | class | TTFT median s | TTFT max s | done median s | done max s |")
    print("|---|---|---:|---:|---:|---:|")
    for policy in ("fcfs", "priority"):
        with LLM(str(model_dir), max_num_seqs=args.max_num_seqs,
                 scheduling_policy=policy) as llm:  # fmt: skip
            llm.generate([PROMPT], SamplingParams(max_tokens=4))  # warm-up
            times = run(llm, args, policy)
        for kind in ("interactive", "background"):
            ttft = [t for t, _ in times[kind]]
            finish = [f for _, f in times[kind]]
            print(f"| {policy} | {kind} | {statistics.median(ttft):.2f} | {max(ttft):.2f} | "
                  f"{statistics.median(finish):.2f} | {max(finish):.2f} |")  # fmt: skip
        print(f"| {policy} | whole run | | | | {times['total'][0][0]:.2f} |")


if __name__ == "__main__":
    main()
