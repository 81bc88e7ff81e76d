"""How a `tessera bench serve` run is shown: a table for people, a JSON document for tools.

Latencies are reported in milliseconds; JSON keys follow `vllm bench serve` where one
exists (`mean_ttft_ms`, `p99_itl_ms`, ...), so existing dashboards read either.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from bench.stats import Distribution, RequestRecord, Summary

LATENCIES = (
    ("ttft", "Time to First Token"),
    ("tpot", "Time per Output Token (excl. 1st)"),
    ("itl", "Inter-token Latency"),
    ("e2e", "End-to-end Latency"),
)
MAX_ERRORS_SHOWN = 5
WIDTH = 50


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def summary_json(summary: Summary) -> dict[str, Any]:
    """The flat numbers: counts, throughputs, and `{mean,p50,p90,p99}_{latency}_ms`."""
    out: dict[str, Any] = {
        "completed": summary.num_completed,
        "failed": summary.num_failed,
        "num_requests": summary.num_requests,
        "duration_s": summary.duration_s,
        "total_input_tokens": summary.total_prompt_tokens,
        "total_output_tokens": summary.total_output_tokens,
        "request_throughput": summary.request_throughput,
        "output_throughput": summary.output_throughput,
        "total_token_throughput": summary.total_token_throughput,
        "request_goodput": summary.goodput_rps,
        "num_good": summary.num_good,
    }
    for key, _ in LATENCIES:
        dist: Distribution = getattr(summary, key)
        out[f"mean_{key}_ms"] = _ms(dist.mean)
        for q, value in dist.percentiles.items():
            out[f"p{q}_{key}_ms"] = _ms(value)
    return out


def _finite(value: Any) -> Any:
    """JSON has no Infinity: an infinite rate is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def result_json(
    config: dict[str, Any], summary: Summary, records: Sequence[RequestRecord]
) -> dict[str, Any]:
    config = {k: v for k, v in config.items() if k != "api_key"}  # never write secrets
    return _finite(
        {
            "config": config,
            "summary": summary_json(summary),
            "errors": dict(Counter(r.error for r in records if r.error)),
            "requests": [_request_json(r) for r in records],
        }
    )


def _request_json(record: RequestRecord) -> dict[str, Any]:
    """One request's numbers; its inter-token gaps only as a count (keeps the file small)."""
    fields = asdict(record)
    fields["num_itl"] = len(fields.pop("itl_s"))
    fields["tpot_s"] = record.tpot_s
    return fields


# A client busier than this share of the run, per client process, falls behind reading
# its streams: the lag it adds counts in the TTFT and ITL it reports.
BUSY_CLIENT_SHARE = 0.8


def client_cpu_report(client_cpu_s: float, duration_s: float, client_processes: int) -> str:
    """The load client's CPU over the run, with a warning when it was the bottleneck."""
    text = _line("Client CPU during the run (s):", client_cpu_s)
    if duration_s > 0 and client_cpu_s > BUSY_CLIENT_SHARE * duration_s * client_processes:
        text += (
            f"\nwarning: the client was busy {client_cpu_s / duration_s:.0%} of the run on "
            f"{client_processes} process(es); its lag counts in TTFT and ITL "
            "(more --client-processes spread it)"
        )
    return text


def _line(label: str, value: Any) -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    return f"{label:<{WIDTH - 12}}{text:>12}"


def format_report(summary: Summary, records: Sequence[RequestRecord]) -> str:
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]
    lines += [
        _line("Successful requests:", summary.num_completed),
        _line("Failed requests:", summary.num_failed),
        _line("Benchmark duration (s):", summary.duration_s),
        _line("Total input tokens:", summary.total_prompt_tokens),
        _line("Total generated tokens:", summary.total_output_tokens),
        _line("Request throughput (req/s):", summary.request_throughput),
        _line("Output token throughput (tok/s):", summary.output_throughput),
        _line("Total token throughput (tok/s):", summary.total_token_throughput),
    ]
    if summary.goodput_rps is not None:
        lines.append(_line("Request goodput (req/s):", summary.goodput_rps))
    for key, title in LATENCIES:
        dist: Distribution = getattr(summary, key)
        lines.append(f" {title} ".center(WIDTH, "-"))
        lines.append(_line(f"Mean {key.upper()} (ms):", _ms(dist.mean)))
        lines += [_line(f"P{q} {key.upper()} (ms):", _ms(v)) for q, v in dist.percentiles.items()]
    lines.append("=" * WIDTH)
    errors = Counter(r.error for r in records if r.error)
    for error, count in errors.most_common(MAX_ERRORS_SHOWN):
        lines.append(f"{count} x {error}")
    return "\n".join(lines)
