"""bench_kv_transfer --stream: a length's row (medians, stream / bulk ratios and their
spread over the rounds' pairs) and the hand-over figures read from the prefill's log."""
from __future__ import annotations

import pytest

from benchmarks.kv_stream_handover import _HANDED, _line, _row


def _run(ttft: float, handover: float, streamed: int = 0) -> dict:
    return {"ttft_ms": ttft, "handover_ms": handover, "blocks": 64, "streamed": streamed}


def test_ratios_are_of_the_medians_and_the_spread_of_each_rounds_pair():
    row = _row({"bulk": [_run(100, 200), _run(300, 100), _run(200, 400)],
                "stream": [_run(100, 20, 32), _run(150, 50, 32), _run(400, 40, 32)]})
    assert row["bulk"]["ttft_ms"] == 200 and row["stream"]["handover_ms"] == 40
    assert row["handover_ratio"] == pytest.approx(40 / 200)
    assert row["ttft_ratio"] == pytest.approx(150 / 200)
    assert row["handover_ratio_range"] == pytest.approx([0.1, 0.5])   # 20/200, 50/100
    assert row["ttft_ratio_range"] == pytest.approx([0.5, 2.0])       # 150/300, 400/200
    assert row["ttft_ratio_rounds"] == pytest.approx([1.0, 0.5, 2.0])
    assert "0.20x, rounds 0.10-0.50" in _line("200 Mbit/s", 1024, row)


def test_the_prefills_hand_over_line_gives_blocks_streamed_and_time():
    line = ("PD prefill handed request cmpl-1-0-ab to 10.200.2.2:8006: 512 blocks (480 "
            "streamed during the prefill), 33554432 bytes in 97.6 ms (PUSH)")
    assert _HANDED.findall(line) == [("512", "480", "97.6")]
