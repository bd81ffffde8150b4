"""bench_serving's summary: goodput at the stated targets and over a TPOT grid."""
from __future__ import annotations

import pytest

from benchmarks.bench_serving import RequestResult
from benchmarks.serving_metrics import format_table, summarize


def _result(i: int, ttft_s: float, tpot_s: float, n: int = 11) -> RequestResult:
    return RequestResult(index=i, ok=True, input_len=8, output_len=n, ttft=ttft_s,
                         e2e=ttft_s + tpot_s * (n - 1))


def test_goodput_counts_requests_meeting_both_targets_over_the_duration():
    results = [_result(0, 0.1, 0.010), _result(1, 0.1, 0.030), _result(2, 3.0, 0.010),
               RequestResult(index=3, error="boom")]
    s = summarize(results, duration=2.0, slo_ttft_ms=1000, slo_tpot_ms=20,
                  tpot_grid_ms=(5, 20, 40))
    assert s["goodput"] == pytest.approx(0.5)  # only request 0, over 2 s
    assert s["slo_attainment"] == pytest.approx(0.25)
    # the grid keeps the TTFT target: request 2 never counts, request 1 from 40 ms
    assert s["goodput_by_tpot_slo"] == pytest.approx({"5": 0.0, "20": 0.5, "40": 1.0})


def test_table_shows_a_row_per_grid_target_and_none_without_a_grid():
    runs = {"a": summarize([_result(0, 0.1, 0.010)], 1.0, 1000, 20, (15, 25.5)),
            "b": summarize([_result(0, 0.1, 0.020)], 1.0, 1000, 20, (15, 25.5))}
    table = format_table(runs)
    row = next(line for line in table.splitlines() if "TPOT <= 15 ms" in line)
    assert row.split()[-2:] == ["1.000", "0.000"]
    assert "TPOT <= 25.5 ms" in table
    assert "TPOT <=" not in format_table({"a": summarize([_result(0, 0.1, 0.01)], 1.0)})
