"""bench_serving --repeat: the rounds' order and the subject's ratio to the best other."""
from __future__ import annotations

import pytest

from benchmarks.serving_rounds import format_verdict, rotated, verdict


def _summary(goodput: float, grid: dict[str, float], tpot_p99: float) -> dict:
    return {"goodput": goodput, "goodput_by_tpot_slo": grid, "slo_tpot_ms": 30.0,
            "tpot_ms": {"p99": tpot_p99}}


def test_each_round_rotates_the_setups_so_no_setup_always_runs_first():
    setups = ["pd", "mix", "default"]
    assert [rotated(setups, i)[0] for i in range(4)] == ["pd", "mix", "default", "pd"]
    assert sorted(rotated(setups, 2)) == sorted(setups)


def test_ratio_is_against_the_best_other_setup_in_the_same_round_at_each_target():
    rounds = [
        {"PD": _summary(0.3, {"20": 0.3, "50": 0.3}, 20.0),
         "MIX": _summary(1.5, {"20": 1.0, "50": 2.0}, 200.0),
         "SLO": _summary(1.8, {"20": 1.5, "50": 1.8}, 19.0)},
        {"PD": _summary(0.3, {"20": 0.3, "50": 0.3}, 18.0),
         "MIX": _summary(0.0, {"20": 0.0, "50": 0.0}, 200.0),
         "SLO": _summary(1.2, {"20": 1.2, "50": 1.2}, 21.0)},
    ]
    v = verdict(rounds, "SLO", reference="PD")
    # round 1: MIX is the best other; round 2: MIX served nothing, PD is the best other
    assert v["goodput_ratio"]["run"] == pytest.approx([1.2, 4.0])
    assert v["goodput_ratio"]["20"] == pytest.approx([1.5, 4.0])
    assert v["goodput_ratio"]["50"] == pytest.approx([0.9, 4.0])
    assert v["tpot_p99_diff_ms"] == pytest.approx([-1.0, 3.0])
    text = format_verdict(v)
    line50 = next(x for x in text.splitlines() if "TPOT <= 50 ms" in x)
    assert line50.split()[-3:] == ["1", "of", "2"]  # 0.90 misses 1.2x, 4.00 reaches it
    assert "no worse in 1 of 2" in text
    assert "(the run's)" in text


def test_no_ratio_where_every_other_setup_served_nothing():
    rounds = [{"A": _summary(0.0, {}, 10.0), "B": _summary(1.0, {}, 10.0)}]
    v = verdict(rounds, "B")
    assert v["goodput_ratio"] == {"run": [None]} and v["tpot_p99_diff_ms"] is None
    assert "no goodput in any other set-up" in format_verdict(v)


def test_a_verdict_needs_the_subject_and_another_setup_in_every_round():
    with pytest.raises(ValueError, match="subject"):
        verdict([{"A": _summary(1, {}, 1)}, {"B": _summary(1, {}, 1)}], "A")
    with pytest.raises(ValueError, match="besides"):
        verdict([{"A": _summary(1, {}, 1)}], "A")


def test_the_bench_picks_the_default_over_the_others_and_pd_as_the_tpot_reference():
    from benchmarks.bench_serving import _in_setup_order, _verdict, build_parser

    def parse(*extra):
        return build_parser().parse_args(["--compare", *extra])

    summaries = {"MIX x2": _summary(1.0, {}, 200.0), "PD default": _summary(1.5, {}, 19.0),
                 "PD always": _summary(0.3, {}, 20.0)}
    rounds = [{"order": ["mix", "default", "pd"], "summaries": summaries}]
    args = parse("--setups", "pd", "mix", "default")
    assert list(_in_setup_order(args, summaries)) == ["PD always", "MIX x2", "PD default"]
    v = _verdict(args, rounds)
    assert (v["subject"], v["reference"]) == ("PD default", "PD always")
    assert v["goodput_ratio"]["run"] == pytest.approx([1.5])
    assert v["tpot_p99_diff_ms"] == pytest.approx([-1.0])
    v = _verdict(parse("--setups", "pd", "mix", "default", "--ratio-of", "mix",
                       "--tpot-reference", "mix"), rounds)
    assert v["subject"] == "MIX x2" and v["reference"] is None
    assert v["goodput_ratio"]["run"] == pytest.approx([1.0 / 1.5])
    assert _verdict(parse("--setups", "pd", "mix"), rounds) is None  # no default: no subject
    with pytest.raises(SystemExit, match="not one of --setups"):
        _verdict(parse("--setups", "pd", "mix", "--ratio-of", "default"), rounds)
