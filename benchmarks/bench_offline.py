"""Online/offline co-location on a PD pair (service + one PREFILL + one DECODE, tiny
model): what offline work costs the online streams, against them alone, in one run.

    python benchmarks/bench_offline.py [--offline 48] [--json]

Rounds, each on the same cluster:
  alone      online streams alone (`--streams` at a time, `--online` requests): TTFT and
             TPOT p50 (TPOT: a stream's time from its first to its last token / tokens-1)
  offline    the same streams beside `--offline` requests sent with "offline": true (sent
             first, so they fill the decode before the streams come): the ratios of TTFT
             and TPOT p50 to alone, and every offline request must complete
  flood      the same streams beside the same flood sent online, for contrast
  throughput the flood alone, offline against online: output tokens/s and the ratio
The online streams carry a TPOT target (`tpot_slo_ms`) of `--tpot-target` x the round's
alone TPOT p50 (the SLO they would be given on this machine as loaded now): that is what the decode keeps its offline work within (engine/offline_gate.py)
and what its pulls check (engine/pd/offline_pull.py). The engines get one torch thread
each; the prefill, the service, etcd and this client are pinned to core 0 and the decode
to core 1, as if it had a machine of its own (`--no-pin`: nothing pinned).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import re
import sys
import tempfile
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import (RequestResult, completion_body, get_model_id,  # noqa: E402
                               percentile, report_environment, send_completion,
                               thread_env)
from xllm_py.cluster.etcd_server import EmbeddedEtcd  # noqa: E402
from xllm_py.utils.config_file import write_settings  # noqa: E402
from xllm_py.utils.procs import engine_args, free_port, spawn  # noqa: E402

MODEL = ["tiny"]  # the id the service serves (read from /v1/models at start)
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi".split()


def prompt(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(words)) + f" {i}"


def tpot_s(r: RequestResult) -> float | None:
    t = r.chunk_times_s
    return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


async def online_streams(url: str, n: int, streams: int, max_tokens: int,
                         tpot_slo_ms: float | None) -> dict:
    """`n` streaming requests, `streams` at a time: TTFT and TPOT p50 (ms)."""
    extra = {"tpot_slo_ms": tpot_slo_ms} if tpot_slo_ms else {}
    results: list[RequestResult] = []
    queue = list(range(n))
    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                body = completion_body(MODEL[0], prompt(i, 24), max_tokens, stream=True, **extra)
                results.append(await send_completion(client, url, body))

        await asyncio.gather(*(worker() for _ in range(streams)))
    ok = [r for r in results if r.ok]
    if not ok:
        raise RuntimeError(f"every online request failed: {results[0].error}")
    tpots = [t for t in map(tpot_s, ok) if t is not None]
    return {"requests": n, "failed": n - len(ok),
            "ttft_p50_ms": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50) * 1e3,
            "tpot_p50_ms": percentile(tpots, 50) * 1e3,
            "tpot_p90_ms": percentile(tpots, 90) * 1e3,
            # where a TPOT goes: the hand-over (prefill's token to decode's first) and
            # the decode's own token gaps
            "handover_gap_p50_ms": percentile([r.itl_s[0] for r in ok if r.itl_s], 50) * 1e3,
            "decode_itl_p50_ms": percentile([g for r in ok for g in r.itl_s[1:]], 50) * 1e3}


async def flood(url: str, n: int, max_tokens: int, offline: bool) -> tuple[list, float]:
    """`n` non-streaming requests at once; (results, wall s)."""
    limits = httpx.Limits(max_connections=n + 8)
    async with httpx.AsyncClient(timeout=900, trust_env=False, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(send_completion(client, url, completion_body(
            MODEL[0], prompt(1000 + i, 48), max_tokens, offline=offline)) for i in range(n)))
        return list(results), time.perf_counter() - t0


def counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


async def beside(url: str, args, target_ms: float, offline: bool) -> dict:
    """The online streams while a flood (offline or online) runs."""
    flood_task = asyncio.create_task(flood(url, args.offline, args.offline_tokens, offline))
    await asyncio.sleep(args.lead_s)  # the flood reaches the decode first
    online = await online_streams(url, args.online, args.streams, args.online_tokens, target_ms)
    results, wall = await flood_task
    online["flood_completed"] = sum(1 for r in results if r.ok)
    online["flood_wall_s"] = wall
    errors = [r.error for r in results if not r.ok]
    if errors:
        online["flood_first_error"] = errors[0]
    return online


async def run(svc: str, prefill: str, decode: str, args) -> dict:
    MODEL[0] = await get_model_id(svc)
    await online_streams(svc, 4, 2, 8, None)  # warm-up: links, kernels
    await flood(svc, 8, 8, True)
    out: dict = {"rounds": []}
    for _ in range(args.repeat):  # interleaved: the machine's load drifts
        rnd = {"alone": await online_streams(svc, args.online, args.streams,
                                             args.online_tokens, None)}
        target = rnd["tpot_target_ms"] = args.tpot_target * rnd["alone"]["tpot_p50_ms"]
        rnd["offline"] = await beside(svc, args, target, offline=True)
        rnd["flood_online"] = await beside(svc, args, target, offline=False)
        for key in ("offline", "flood_online"):
            for m in ("ttft", "tpot"):
                rnd[key][f"{m}_ratio"] = rnd[key][f"{m}_p50_ms"] / rnd["alone"][f"{m}_p50_ms"]
        out["rounds"].append(rnd)
    for key in ("offline", "flood_online"):
        for m in ("ttft", "tpot"):
            out[f"{key}_{m}_ratio"] = percentile(
                [r[key][f"{m}_ratio"] for r in out["rounds"]], 50)
    out["offline_all_completed"] = all(r["offline"]["flood_completed"] == args.offline
                                       for r in out["rounds"])
    tput = {}
    for kind in ("offline", "online", "offline", "online")[:2 * args.repeat_throughput]:
        results, wall = await flood(svc, args.offline, args.offline_tokens, kind == "offline")
        tokens = sum(r.num_completion_tokens for r in results if r.ok)
        errors = [r.error for r in results if not r.ok]
        tput.setdefault(kind, []).append({"completed": sum(1 for r in results if r.ok),
                                          "wall_s": wall, "output_tokens_per_s": tokens / wall,
                                          "first_error": errors[0] if errors else None})
    out["throughput"] = tput
    out["offline_vs_online_throughput"] = (
        percentile([t["output_tokens_per_s"] for t in tput["offline"]], 50)
        / percentile([t["output_tokens_per_s"] for t in tput["online"]], 50))
    out["metrics"] = {
        "decode_pulls_sent": counter(decode, "xllm_pd_pulls_sent_total"),
        "decode_pulls_answered": counter(decode, "xllm_pd_pulls_answered_total"),
        "prefill_offline_handed": counter(prefill, "xllm_pd_offline_handed_total"),
        "decode_offline_suspensions": counter(decode, "xllm_offline_suspensions_total"),
        "decode_offline_preemptions": counter(decode, "xllm_offline_preemptions_total")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--offline", type=int, default=48, help="requests in the flood")
    ap.add_argument("--offline-tokens", type=int, default=256,
                    help="max_tokens of the flood (it outlasts the online round)")
    ap.add_argument("--online", type=int, default=24, help="online requests a round")
    ap.add_argument("--streams", type=int, default=4, help="online streams at a time")
    ap.add_argument("--online-tokens", type=int, default=48, help="max_tokens online")
    ap.add_argument("--tpot-target", type=float, default=1.3,
                    help="the online TPOT target, x the alone TPOT p50")
    ap.add_argument("--lead-s", type=float, default=1.0,
                    help="the flood's head start before the online streams")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the engines to cores")
    ap.add_argument("--step-trace", action="store_true",
                    help="the engines' step traces (settings file: step_trace) into the log directory")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (alone, offline, flood)")
    ap.add_argument("--repeat-throughput", type=int, default=2, choices=(1, 2),
                    help="flood-alone runs of each kind")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    logs = pathlib.Path(tempfile.mkdtemp(prefix="bench-offline-"))
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})  # this client, etcd and the service beside the prefill
    etcd = EmbeddedEtcd().start()
    procs = []
    try:
        hp, rp = free_port(), free_port()
        # a long etcd lease: a loaded machine must not evict the engines mid-round
        ttl = ["--etcd-ttl", "15"]
        # PD always: every prompt on the prefill, every offline one pulled by the decode
        svc = spawn("service", "xllm_service", ["--model", "tiny", "--etcd", etcd.endpoint,
                                                "--http-port", str(hp), "--rpc-port", str(rp),
                                                "--load-balance-policy", "LEAST_LOAD", *ttl,
                                                *write_settings(logs / "service.yaml",
                                                                {"evict_grace_s": 10})], logs,
                    http_url=f"http://127.0.0.1:{hp}", cpu=None if args.no_pin else 0)
        procs.append(svc)
        engines = {}
        for core, role in enumerate(("PREFILL", "DECODE")):
            port = free_port()
            trace = {"step_trace": str(logs / f"{role.lower()}.steps.jsonl")}
            settings = write_settings(logs / f"{role.lower()}.yaml", {
                "etcd_ttl": 15, **(trace if args.step_trace else {})})
            engines[role] = spawn(role.lower(), "xllm_py.engine",
                                  engine_args(role, port, etcd=etcd.endpoint, extra=settings),
                                  logs, http_url=f"http://127.0.0.1:{port}", env=thread_env(1),
                                  cpu=None if args.no_pin else core)
            procs.append(engines[role])
        for p in engines.values():
            p.wait_ready(240)
        svc.wait_ready(60, path="/readiness")
        result = asyncio.run(run(svc.http_url, engines["PREFILL"].http_url,
                                 engines["DECODE"].http_url, args))
    finally:
        for p in reversed(procs):
            p.terminate()
        etcd.stop()
    result["logs"] = str(logs)
    report_environment(result, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
        return 0
    for i, rnd in enumerate(result["rounds"]):
        a = rnd["alone"]
        print(f"round {i + 1}: alone TTFT p50 {a['ttft_p50_ms']:.1f} ms, TPOT p50 "
              f"{a['tpot_p50_ms']:.2f} ms (TPOT target beside the floods "
              f"{rnd['tpot_target_ms']:.2f} ms)")
        for name, key in (("beside offline", "offline"), ("beside online ", "flood_online")):
            r = rnd[key]
            print(f"  {name}: TTFT p50 {r['ttft_p50_ms']:.1f} ms ({r['ttft_ratio']:.2f}x), "
                  f"TPOT p50 {r['tpot_p50_ms']:.2f} ms ({r['tpot_ratio']:.2f}x), flood "
                  f"{r['flood_completed']}/{args.offline} done in {r['flood_wall_s']:.1f} s")
    print(f"median ratios to alone: beside offline TTFT {result['offline_ttft_ratio']:.2f}x, "
          f"TPOT {result['offline_tpot_ratio']:.2f}x; beside the online flood TTFT "
          f"{result['flood_online_ttft_ratio']:.2f}x, TPOT {result['flood_online_tpot_ratio']:.2f}x;"
          f" every offline request completed: {result['offline_all_completed']}")
    t = result["throughput"]
    print("flood alone, output tok/s: offline "
          + ", ".join(f"{x['output_tokens_per_s']:.0f}" for x in t["offline"]) + "; online "
          + ", ".join(f"{x['output_tokens_per_s']:.0f}" for x in t["online"])
          + f": offline/online {result['offline_vs_online_throughput']:.2f}x")
    print(f"metrics: {result['metrics']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
