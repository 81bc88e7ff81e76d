"""Numbers of a serving benchmark run: per-request records in, a summary out. Pure functions.

Units: every time here is in seconds (the report converts to milliseconds). Definitions,
for one request that streamed its answer:

    send ─────── first content chunk ── chunk ── chunk ── ... ── last chunk
    |<── TTFT ──>|<─ ITL ─>|<─ ITL ─>|                          |
    |<──────────────────────── E2E ────────────────────────────>|

    TPOT = (E2E - TTFT) / (output_tokens - 1)   (undefined for a single output token)

Goodput is the rate of completed requests that met every SLO given (TTFT and/or TPOT); a
request whose TPOT is undefined meets the TPOT SLO.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES: tuple[int, ...] = (50, 90, 99)


@dataclass(frozen=True)
class RequestRecord:
    """What one benchmark request measured. `is_success` False means it counts as failed."""

    is_success: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: tuple[float, ...] = ()  # gaps between consecutive content chunks
    num_prompt_tokens: int = 0  # from the server's usage; 0 when it sent none
    num_output_tokens: int = 0  # from usage, else the number of content chunks
    has_usage: bool = False
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        return tpot(self.e2e_s, self.ttft_s, self.num_output_tokens)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in seconds (all None when there were no values)."""

    count: int
    mean: float | None
    percentiles: dict[int, float | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Summary:
    """Everything a run reports; `goodput_rps` is None when no SLO was given."""

    num_requests: int
    num_completed: int
    num_failed: int
    duration_s: float
    total_prompt_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    goodput_rps: float | None
    num_good: int | None
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default method."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: Sequence[float], qs: Sequence[int] = PERCENTILES) -> Distribution:
    if not values:
        return Distribution(0, None, dict.fromkeys(qs))
    mean = math.fsum(values) / len(values)
    return Distribution(len(values), mean, {q: percentile(values, q) for q in qs})


def tpot(e2e_s: float | None, ttft_s: float | None, num_output_tokens: int) -> float | None:
    """Time per output token after the first; None when it is undefined (< 2 tokens)."""
    if e2e_s is None or ttft_s is None or num_output_tokens < 2:
        return None
    return max(0.0, e2e_s - ttft_s) / (num_output_tokens - 1)


def is_good(record: RequestRecord, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    """Whether a request completed within every SLO given."""
    if not record.is_success:
        return False
    if slo_ttft_s is not None and (record.ttft_s is None or record.ttft_s > slo_ttft_s):
        return False
    request_tpot = record.tpot_s
    return slo_tpot_s is None or request_tpot is None or request_tpot <= slo_tpot_s


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
) -> Summary:
    """Aggregate one run. Latencies and token counts come from completed requests only."""
    done = [r for r in records if r.is_success]
    rate = 1.0 / duration_s if duration_s > 0 else 0.0
    prompt_tokens = sum(r.num_prompt_tokens for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    num_good = None
    if slo_ttft_s is not None or slo_tpot_s is not None:
        num_good = sum(is_good(r, slo_ttft_s, slo_tpot_s) for r in done)
    return Summary(
        num_requests=len(records),
        num_completed=len(done),
        num_failed=len(records) - len(done),
        duration_s=duration_s,
        total_prompt_tokens=prompt_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) * rate,
        output_throughput=output_tokens * rate,
        total_token_throughput=(prompt_tokens + output_tokens) * rate,
        goodput_rps=None if num_good is None else num_good * rate,
        num_good=num_good,
        ttft=distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=distribution([t for r in done if (t := r.tpot_s) is not None]),
        itl=distribution([gap for r in done for gap in r.itl_s]),
        e2e=distribution([r.e2e_s for r in done if r.e2e_s is not None]),
    )
