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
    assert list(SETUPS) == ["pd", "mix", "pd-slo"]
    args = build_parser().parse_args(["--compare", "--workload", "mixed"])
    assert args.setups == ["pd", "mix"]  # pd-slo runs once the service has its flags
    args = build_parser().parse_args(["--compare", "--setups", "pd", "mix", "pd-slo"])
    assert [SETUPS[n][1][:2] for n in args.setups] == [
        ["--prefill", "1"], ["--mix", "2"], ["--prefill", "1"]]
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
