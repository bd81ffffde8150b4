"""The elastic decision at fleet scale: 64 simulated engines (xllm_py/sim: the real engine
process with a time model for the forward; four host processes of 16) behind a real
service and etcd, all elastic MIX instances starting half prefill, half decode. A
prefill-heavy load, then a decode-heavy one, each needing most of the fleet on its heavy
side: the master moves the split toward each phase's heavy side (instances acknowledge
their duty in etcd), and every request completes.
bench_elastic.py scores the same decision against fixed splits on 16 instances."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import pytest

from benchmarks.bench_elastic import acked, phases, run_phase, watch_split
from xllm_py.cluster.etcd_client import EtcdClient
from xllm_py.cluster import slo_defaults
from xllm_py.cluster.latency_profile import LatencyProfile
from xllm_py.sim.fleet import Fleet
from xllm_py.sim.time_model import TimeModel

pytestmark = pytest.mark.integration

N = 64
# Slow made-up steps, so that most of 64 instances are busy at request rates one Python
# client and service on two cores carry: a 512-token prompt 20 s (past the router's
# local_prefill_max_tokens: prefills compute it); a decode step 50 ms + 190 ms a stream
# (the TPOT target, 2 s, holds 10 streams).
TIME_MODEL = TimeModel(prefill_base_ms=10.0, prefill_ms_per_token=40.0, decode_base_ms=50.0,
                       decode_ms_per_seq=190.0, decode_ms_per_ctx_token=0.0)
TRACE = argparse.Namespace(heavy_share=0.6, long_prompt=512, short_prompt=16, long_output=12,
                           short_output=4)
PHASE_S = 40.0  # (the master's defaults: an instance flips again 30 s after its last flip)


@pytest.fixture
def fleet(tmp_path):
    from xllm_py.model.tiny import ensure_tiny_model

    profile = tmp_path / "profile.json"
    TIME_MODEL.save(profile)
    f = Fleet(str(profile), str(ensure_tiny_model("tiny")), tmp_path / "logs",
              service_args=["--elastic-pd", "on"])
    try:
        f.start(num_services=1)
        f.add_engines("MIX", N)
        yield f
    finally:
        f.stop()


async def test_the_split_follows_the_load_on_64_instances(fleet):
    await fleet.wait_all_active(240)
    # The master assigns the unassigned instances at once (half and half: no load yet)
    async with EtcdClient(fleet.etcd.endpoint, namespace=fleet.namespace) as etcd:
        deadline, duties = time.monotonic() + 120, {}
        while len(duties) < N:
            assert time.monotonic() < deadline, f"{len(duties)} of {N} took a duty"
            await asyncio.sleep(0.5)
            duties = await acked(etcd)
    profile = LatencyProfile.from_dict(json.loads(TIME_MODEL.to_json()))
    targets = (slo_defaults.ttft_target_ms([profile]), slo_defaults.tpot_target_ms([profile]))
    prefill_heavy, decode_heavy, _ = phases(profile, N, *targets, TRACE)
    timeline: list = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_split(fleet, stop, timeline))
    ends, failed = [], {}
    try:
        for phase in (prefill_heavy, decode_heavy):
            results = await run_phase(fleet.services[0].http_url, phase, PHASE_S,
                                      random.Random(7), max_inflight=10_000)
            ends.append(time.monotonic())
            failed[phase.name] = [r.error for r in results if not r.ok]
    finally:
        stop.set()
        await watcher
    t0 = timeline[0][0]
    print(f"\nrates {prefill_heavy.rate:.1f}/s, {decode_heavy.rate:.1f}/s; phases ended "
          f"{[round(t - t0, 1) for t in ends]} s; splits (s, (P, D)): "
          f"{[(round(t - t0, 1), s) for t, s in timeline]}")
    for name, errors in failed.items():
        assert not errors, f"{name}: {len(errors)} failed: {errors[:3]}"
    split_at = {name: _split_at(timeline, t) for name, t in
                zip((prefill_heavy.name, decode_heavy.name), ends)}
    needed = round(TRACE.heavy_share * N)
    p, d = split_at[prefill_heavy.name]
    assert p >= needed and p + d == N, f"prefill-heavy ended at {p}P{d}D"
    p, d = split_at[decode_heavy.name]
    assert d >= needed and p + d == N, f"decode-heavy ended at {p}P{d}D"


def _split_at(timeline: list, t: float) -> tuple[int, int]:
    return [s for ts, s in timeline if ts <= t][-1]
