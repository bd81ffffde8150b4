"""bench_serving's workloads and --compare set-ups (benchmarks/serving_workload.py)."""
from __future__ import annotations

import pytest

from benchmarks.bench_serving import SETUPS, build_parser
from benchmarks.serving_workload import WorkloadSpec, arrival_offsets, build_requests


def test_mixed_workload_lengths_and_share():
    spec = WorkloadSpec(num_requests=2000, input_len=512, output_len=16, workload="mixed",
                        short_frac=0.7, short_len=128, long_len=(1024, 2048), seed=3)
    reqs = build_requests(spec)
    assert all(len(r.prompt) == r.input_len and r.output_len == 16 for r in reqs)
    long = [r.input_len for r in reqs if r.input_len != 128]
    assert 0.66 < 1 - len(long) / len(reqs) < 0.74
    assert 1024 <= min(long) < 1100 and 1950 < max(long) <= 2048
    assert [r.prompt for r in build_requests(spec)] == [r.prompt for r in reqs]  # seeded


def test_uniform_workload_is_unchanged_by_the_mixed_fields():
    spec = WorkloadSpec(num_requests=5, input_len=40, output_len=8, short_len=3)
    assert [r.input_len for r in build_requests(spec)] == [40] * 5


def test_poisson_arrivals_average_the_rate():
    offsets = arrival_offsets(4000, request_rate=2.0, seed=1)
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert offsets[-1] / len(offsets) == pytest.approx(0.5, rel=0.08)


def test_compare_setups_each_have_launcher_flags():
    assert list(SETUPS) == ["pd", "mix", "default"]
    args = build_parser().parse_args(["--compare", "--workload", "mixed"])
    assert args.setups == ["pd", "mix"]
    args = build_parser().parse_args(["--compare", "--setups", "pd", "mix", "default"])
    assert [SETUPS[n][1][:2] for n in args.setups] == [
        ["--prefill", "1"], ["--mix", "2"], ["--prefill", "1"]]
    # the default set-up is the cluster without a flag; PD always says what it changes
    assert SETUPS["default"][1] == ["--prefill", "1", "--decode", "1"]
    # (LEAST_LOAD decides no path per request: every prompt on the prefill)
    assert "--service-arg=--load-balance-policy=LEAST_LOAD" in SETUPS["pd"][1]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--setups", "nope"])


def test_prefill_args_reach_only_the_set_ups_with_a_prefill(tmp_path):
    from benchmarks.bench_serving import _launch_args
    args = build_parser().parse_args(["--compare", "--engine-arg=--a=1",
                                      "--prefill-arg=--max-num-batched-tokens=512"])
    pd = _launch_args(args, SETUPS["pd"][1], tmp_path)
    mix = _launch_args(args, SETUPS["mix"][1], tmp_path)
    assert "--prefill-arg=--max-num-batched-tokens=512" in pd
    assert not any(a.startswith("--prefill-arg") for a in mix)
    assert "--engine-arg=--a=1" in pd and "--engine-arg=--a=1" in mix


def test_goodput_is_counted_at_the_slo_the_default_set_up_states(monkeypatch):
    from benchmarks.bench_serving import RequestResult
    from benchmarks.serving_rounds import at_stated_slo, stated_slo
    from benchmarks.serving_metrics import summarize

    def res(i: int, ttft: float, tpot: float) -> RequestResult:
        return RequestResult(i, ok=True, output_len=11, ttft=ttft, e2e=ttft + 10 * tpot)

    runs = {"a": [res(0, 1.0, 0.020), res(1, 3.0, 0.020), res(2, 1.0, 0.040)]}
    summaries = {"a": summarize(runs["a"], 10.0)}
    args = build_parser().parse_args(["--compare", "--slo-tpot-grid", "50"])
    got = at_stated_slo(args, summaries, runs, (2000.0, 30.0))["a"]
    assert got["goodput"] == pytest.approx(0.1)  # only request 0 meets 2 s and 30 ms
    assert got["goodput_by_tpot_slo"]["50"] == pytest.approx(0.2)
    assert at_stated_slo(args, summaries, runs, None) is summaries  # nothing stated
    given = build_parser().parse_args(["--compare", "--slo-ttft-ms", "5000"])
    assert at_stated_slo(given, summaries, runs, (2000.0, 30.0)) is summaries  # given wins

    class Reply:
        text = ('# HELP x\nxllm_service_slo_target_ms{target="ttft"} 2716.5\n'
                'xllm_service_slo_target_ms{target="tpot"} 22.9\n')

    import benchmarks.serving_rounds as bench
    monkeypatch.setattr(bench.httpx, "get", lambda *a, **k: Reply())
    assert stated_slo("http://x") == (2716.5, 22.9)
    Reply.text = "xllm_service_requests_total 3\n"
    assert stated_slo("http://x") is None
