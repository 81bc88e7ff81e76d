"""bench.stats: percentiles equal numpy's, TPOT edge cases, goodput against SLOs, summaries."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bench.stats import (
    RequestRecord,
    distribution,
    is_good,
    percentile,
    summarize,
    tpot,
)


@pytest.mark.parametrize("size", [1, 2, 3, 10, 101])
def test_percentiles_match_numpy(size):
    rng = random.Random(size)
    values = [rng.expovariate(3.0) for _ in range(size)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_of_nothing_is_none():
    dist = distribution([])
    assert dist.count == 0 and dist.mean is None
    assert dist.percentiles == {50: None, 90: None, 99: None}
    dist = distribution([1.0, 2.0, 6.0])
    assert dist.mean == pytest.approx(3.0)
    assert dist.percentiles[50] == 2.0


def test_tpot():
    assert tpot(1.0, 0.2, 5) == pytest.approx(0.2)
    assert tpot(1.0, 0.2, 2) == pytest.approx(0.8)
    assert tpot(1.0, 0.2, 1) is None  # one token: nothing after the first
    assert tpot(1.0, 0.2, 0) is None
    assert tpot(None, 0.2, 5) is None


def record(ttft, e2e, tokens, ok=True):
    return RequestRecord(ok, ttft_s=ttft, e2e_s=e2e, num_output_tokens=tokens)


def test_goodput_logic():
    fast = record(0.1, 0.5, 5)  # tpot 0.1
    slow_start = record(0.9, 1.3, 5)  # tpot 0.1
    slow_decode = record(0.1, 2.1, 5)  # tpot 0.5
    one_token = record(0.1, 0.1, 1)  # tpot undefined: meets any TPOT SLO
    failed = record(None, None, 0, ok=False)
    assert is_good(fast, 0.2, 0.2)
    assert not is_good(slow_start, 0.2, 0.2)
    assert is_good(slow_start, None, 0.2)
    assert not is_good(slow_decode, 0.2, 0.2)
    assert is_good(slow_decode, 0.2, None)
    assert is_good(one_token, 0.2, 0.001)
    assert not is_good(failed, None, None)

    records = [fast, slow_start, slow_decode, one_token, failed]
    summary = summarize(records, duration_s=2.0, slo_ttft_s=0.2, slo_tpot_s=0.2)
    assert summary.num_good == 2  # fast, one_token
    assert summary.goodput_rps == pytest.approx(1.0)
    assert summarize(records, duration_s=2.0).goodput_rps is None


def test_summary_counts_and_throughput():
    records = [
        RequestRecord(True, 0.1, 0.4, (0.1, 0.2), num_prompt_tokens=10, num_output_tokens=3),
        RequestRecord(True, 0.3, 0.3, (), num_prompt_tokens=20, num_output_tokens=1),
        RequestRecord(False, error="HTTP 500: boom"),
    ]
    summary = summarize(records, duration_s=4.0)
    assert (summary.num_requests, summary.num_completed, summary.num_failed) == (3, 2, 1)
    assert summary.total_prompt_tokens == 30 and summary.total_output_tokens == 4
    assert summary.request_throughput == pytest.approx(0.5)
    assert summary.output_throughput == pytest.approx(1.0)
    assert summary.total_token_throughput == pytest.approx(8.5)
    assert summary.ttft.mean == pytest.approx(0.2)
    assert summary.itl.count == 2 and summary.itl.mean == pytest.approx(0.15)
    assert summary.tpot.count == 1 and summary.tpot.mean == pytest.approx(0.15)
    assert summary.e2e.percentiles[50] == pytest.approx(0.35)
