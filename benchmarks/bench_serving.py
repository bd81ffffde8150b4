"""Serving benchmark for an OpenAI-compatible endpoint (xllm_service or an engine).

Stages: build the workload (prompts of random token ids, exact output lengths via
`ignore_eos`) -> warm up -> send requests (Poisson arrivals at --request-rate and/or at
most --concurrency in flight) over streaming /v1/completions -> per-request TTFT, ITL,
TPOT, end-to-end latency -> percentiles, throughput, goodput under SLOs -> table,
--json, --plot.

    # against a running endpoint
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8888/v1 \\
        --request-rate 2 --num-requests 100 --input-len 512 --output-len 64
    # 1 prefill + 1 decode vs 2 MIX on this machine, same workload, side by side
    python benchmarks/bench_serving.py --compare --input-len 1024 --output-len 64 \\
        --request-rate 1 --num-requests 60 --json bench_out/pd_vs_mix.json --plot bench_out/pd_vs_mix.png
    # mixed prompts: 70% of 128 tokens, 30% of 1024-2048 (Poisson arrivals at the rate)
    python benchmarks/bench_serving.py --compare --workload mixed --output-len 64 \\
        --request-rate 1 --num-requests 60 --setups pd mix
    # the same three times (each round in a rotated order): the spread of the default
    # set-up's goodput over the better of pd and mix, and its TPOT p99 against pd's
    python benchmarks/bench_serving.py --compare --workload mixed --output-len 64 \\
        --request-rate 1 --num-requests 60 --setups pd mix default --repeat 3

Set-ups of --compare (``SETUPS``: name -> label and launcher flags): ``pd`` (1 prefill +
1 decode, every prompt prefilled on the prefill engine: LEAST_LOAD, ALWAYS), ``mix`` (2
MIX), ``default`` (1P+1D as the launcher starts it without flags: the service decides
the path per request, SLO_AWARE over the latency profiles the engines measured at
start-up). Without --slo-ttft-ms / --slo-tpot-ms each round's goodput is counted at the
SLO the default set-up's service stated (its xllm_service_slo_target_ms, read at the end
of its run).

Definitions (as vLLM's benchmark_serving): TTFT = first token received - request sent;
ITL = gaps between successive token chunks; TPOT = (e2e - TTFT) / (output tokens - 1) per
request; goodput = completed requests per second that meet every given SLO.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import pathlib
import signal
import sys
import tempfile
import time
from typing import Any


ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import report_environment  # noqa: E402
from benchmarks.serving_metrics import (PERCENTILES, format_table, percentile,  # noqa: E402,F401
                                        plot_cdfs, summarize)
from benchmarks.serving_rounds import (at_stated_slo, format_verdict, rotated,  # noqa: E402
                                       stated_slo, verdict)
from benchmarks.serving_client import (RequestResult, resolve_model,  # noqa: E402,F401
                                       run_load, send_request)
from benchmarks.serving_workload import (BenchRequest, WorkloadSpec,  # noqa: E402,F401
                                         arrival_offsets, build_requests)

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- runs

def _warmup_requests(spec: WorkloadSpec, n: int) -> list[BenchRequest]:
    # other prompts than the measured ones, so the prefix cache gives the run nothing
    return build_requests(spec, num=n, seed_offset=1_000_003)


async def bench_endpoint(base_url: str, args: argparse.Namespace, spec: WorkloadSpec,
                         label: str) -> tuple[dict[str, Any], list[RequestResult]]:
    base_url = base_url.rstrip("/")
    model = args.model_name or await resolve_model(base_url)
    if args.warmup:
        warm, _ = await run_load(base_url, model, _warmup_requests(spec, args.warmup),
                                 math.inf, args.concurrency or 4, label=f"{label} warmup")
        bad = [r.error for r in warm if not r.ok]
        if bad:
            raise RuntimeError(f"{label}: warmup requests failed: {bad[:3]}")
    results, duration = await run_load(base_url, model, build_requests(spec), args.request_rate,
                                       args.concurrency, seed=spec.seed, label=label)
    return summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms,
                     tuple(args.slo_tpot_grid)), results


def _launch_args(args: argparse.Namespace, shape: list[str], log_dir: pathlib.Path) -> list[str]:
    from xllm_py.utils.procs import free_port

    argv = [*shape, "--model", args.launch_model, "--http-port", str(free_port()),
            "--log-dir", str(log_dir), "--log-level", "WARNING"]
    if not args.no_pin_cores:
        argv.append("--pin-cores")
    argv += [f"--engine-arg={a}" for a in args.engine_arg]
    if "--prefill" in shape:
        argv += [f"--prefill-arg={a}" for a in args.prefill_arg]
    if "--decode" in shape:
        argv += [f"--decode-arg={a}" for a in args.decode_arg]
    argv += [f"--kv-transfer-backend={args.kv_transfer_backend}"] if args.kv_transfer_backend else []
    return argv


# --compare set-ups: name -> (column label, launcher flags), on the same cores one after
# the other. "default": the cluster as `python -m xllm_py.launch` starts it, no flag (the
# service decides the path per request, SLO_AWARE over the profiles the engines measure at
# start-up, targets derived from them: issue 31); "pd": every prompt on the prefill.
SETUPS: dict[str, tuple[str, list[str]]] = {
    "pd": ("PD always", ["--prefill", "1", "--decode", "1",
                         "--service-arg=--load-balance-policy=LEAST_LOAD"]),
    "mix": ("MIX x2", ["--mix", "2"]),
    "default": ("PD default", ["--prefill", "1", "--decode", "1"]),
}
# The set-up whose service states the SLO the goodput is measured at (without --slo-*).
STATES_SLO = "default"


def run_compare(args: argparse.Namespace, spec: WorkloadSpec, setups: list[str],
                root: pathlib.Path) -> dict[str, Any]:
    """Same workload against each of `setups` (``SETUPS`` names), one after the other;
    cluster logs under `root`/<set-up>; "stated": the SLO the STATES_SLO set-up's service
    stated at the end of its run (None if not run)."""
    from xllm_py.launch import Cluster, build_parser as launch_parser

    summaries: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[RequestResult]] = {}
    stated = None
    for name in setups:
        label, shape = SETUPS[name]
        log_dir = root / name
        cluster = Cluster(launch_parser().parse_args(_launch_args(args, shape, log_dir)))
        try:
            t0 = time.perf_counter()
            cluster.start()
            logger.info("%s up in %.1fs at %s (logs %s)", label, time.perf_counter() - t0,
                        cluster.url, log_dir)
            summaries[label], runs[label] = asyncio.run(
                bench_endpoint(cluster.url + "/v1", args, spec, label))
            if name == STATES_SLO:
                stated = stated_slo(cluster.url)
                logger.info("%s states TTFT / TPOT targets %s ms", label, stated)
        finally:
            cluster.stop()
    return {"summaries": summaries, "runs": runs, "stated": stated}


def _result_rows(results: list[RequestResult]) -> list[dict[str, Any]]:
    return [{"index": r.index, "ok": r.ok, "error": r.error, "input_len": r.input_len,
             "output_len": r.output_len, "ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e,
             "itl_s": r.itl} for r in results]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/bench_serving.py",
        description="Load generator for an OpenAI endpoint: TTFT/TPOT/ITL/E2E percentiles, "
                    "throughput, goodput; --compare runs PD (1P+1D) vs 2 MIX locally.")
    p.add_argument("--base-url", default="http://127.0.0.1:8888/v1",
                   help="OpenAI base URL (ends in /v1)")
    p.add_argument("--model-name", default=None, help="model id (default: first of /v1/models)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in req/s (default inf: all at once)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="at most this many requests in flight (alone: a closed loop)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--warmup", type=int, default=4, help="requests sent first, not measured")
    p.add_argument("--workload", choices=["uniform", "mixed"], default="uniform",
                   help="uniform: --input-len (jittered); mixed: --short-frac of the prompts "
                        "--short-len tokens, the rest uniform in --long-len")
    p.add_argument("--short-frac", type=float, default=0.7)
    p.add_argument("--short-len", type=int, default=128)
    p.add_argument("--long-len", type=int, nargs=2, default=[1024, 2048], metavar=("MIN", "MAX"))
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--len-jitter", type=float, default=0.0,
                   help="lengths uniform in [len*(1-j), len*(1+j)]")
    p.add_argument("--prompt-kind", choices=["tokens", "words"], default="tokens",
                   help="random token ids (exact input length) or random words (text)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids are drawn below this (default: the tiny model's vocabulary)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="TTFT target of the goodput (--compare without --slo-*: the SLO the "
                        "default set-up's service states)")
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-tpot-grid", type=float, nargs="*", default=[], metavar="MS",
                   help="goodput also at each of these TPOT targets (with --slo-ttft-ms), "
                        "from the same requests, e.g. --slo-tpot-grid 20 30 50")
    p.add_argument("--json", default=None, help="write the summary (and per-request rows) here")
    p.add_argument("--plot", default=None, help="write CDFs of TTFT, TPOT and ITL here (.png; with --repeat, round 1's)")
    g = p.add_argument_group("--compare (local clusters via xllm_py.launch)")
    g.add_argument("--compare", action="store_true",
                   help="run the workload on each of --setups, side by side")
    g.add_argument("--setups", nargs="+", choices=list(SETUPS), default=["pd", "mix"],
                   help="set-ups of --compare (default: pd mix)")
    g.add_argument("--launch-model", default="tiny", help="model for the local clusters")
    g.add_argument("--engine-arg", action="append", default=[],
                   help="extra engine flag, e.g. --engine-arg=--max-model-len=4096")
    g.add_argument("--prefill-arg", action="append", default=[],
                   help="extra flag of the prefill engines (pd, default), e.g. "
                        "--prefill-arg=--max-num-batched-tokens=512")
    g.add_argument("--decode-arg", action="append", default=[],
                   help="extra flag of the decode engines (pd, default), e.g. "
                        "--decode-arg=--config=decode.yaml (a settings file: "
                        "prompt_tpot_target_ms: 18)")
    g.add_argument("--kv-transfer-backend", choices=["ucx", "tcp"], default=None,
                   help="KV transfer backend of the PD cluster (default: the launcher's)")
    g.add_argument("--no-pin-cores", action="store_true", help="do not pin engines to cores")
    g.add_argument("--log-dir", default=None, help="cluster logs (default: a temp dir)")
    g.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the set-ups N times, each round in a rotated order; prints "
                        "each round and the spread of the goodput ratio")
    g.add_argument("--ratio-of", choices=list(SETUPS), default=None,
                   help="the set-up whose goodput is divided by the best other's "
                        "(default: default when compared)")
    g.add_argument("--tpot-reference", choices=list(SETUPS), default=None,
                   help="the set-up whose TPOT p99 the ratio-of set-up's is set against "
                        "(default: pd when compared)")
    p.add_argument("--log-level", default="INFO")
    return p


def _default_vocab(args: argparse.Namespace) -> int:
    if args.vocab_size:
        return args.vocab_size
    from xllm_py.model.tiny import TINY_VOCAB_SIZE

    return TINY_VOCAB_SIZE


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "matplotlib"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.repeat < 1:
        raise SystemExit("--repeat must be >= 1")
    if args.request_rate <= 0:
        raise SystemExit("--request-rate must be positive")
    if not 0 <= args.len_jitter < 1:
        raise SystemExit("--len-jitter must be in [0, 1)")
    if not 0 <= args.short_frac <= 1 or not 0 < args.long_len[0] <= args.long_len[1]:
        raise SystemExit("--short-frac must be in [0, 1] and --long-len MIN <= MAX, both > 0")
    spec = WorkloadSpec(num_requests=args.num_requests, input_len=args.input_len,
                        output_len=args.output_len, len_jitter=args.len_jitter,
                        prompt_kind=args.prompt_kind, vocab_size=_default_vocab(args),
                        seed=args.seed, workload=args.workload, short_frac=args.short_frac,
                        short_len=args.short_len, long_len=tuple(args.long_len))
    # SIGTERM unwinds like Ctrl-C, so clusters started by --compare are stopped
    signal.signal(signal.SIGTERM, _raise_interrupt)
    environment = report_environment()
    rounds: list[dict[str, Any]] = []
    if args.compare:
        root = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="xllm-bench-"))
        for i in range(args.repeat):
            order = rotated(args.setups, i)
            out = run_compare(args, spec, order, root / f"round{i + 1}" if args.repeat > 1 else root)
            out["summaries"] = at_stated_slo(args, out["summaries"], out["runs"], out["stated"])
            if out["stated"] is not None:
                print(f"\nround {i + 1}: the default set-up states TTFT <= {out['stated'][0]:.0f}"
                      f" ms, TPOT <= {out['stated'][1]:.1f} ms")
            rounds.append({"order": order, "summaries": out["summaries"], "runs": out["runs"],
                           "stated_slo_ms": out["stated"]})
            if args.repeat > 1:
                print(f"\nround {i + 1} of {args.repeat} (order {' '.join(order)})")
                print(format_table(_in_setup_order(args, out["summaries"])))
        summaries, runs = _in_setup_order(args, rounds[0]["summaries"]), rounds[0]["runs"]
    else:
        summary, results = asyncio.run(bench_endpoint(args.base_url, args, spec, "run"))
        summaries, runs = {"run": summary}, {"run": results}
    load = (f"rate {args.request_rate:g} req/s" if not math.isinf(args.request_rate)
            else "all at once") + (f", concurrency {args.concurrency}" if args.concurrency else "")
    inputs = (f"input {spec.input_len}" if spec.workload == "uniform" else
              f"input {spec.short_frac:.0%} x {spec.short_len}, the rest "
              f"{spec.long_len[0]}-{spec.long_len[1]}")
    print(f"\nworkload: {spec.num_requests} requests, {inputs}, output "
          f"{spec.output_len} (jitter {spec.len_jitter:g}, {spec.prompt_kind}), {load}")
    if len(rounds) <= 1:
        print(format_table(summaries))
    every_round = [r["summaries"] for r in rounds] or [summaries]
    for round_summaries in every_round:
        for name, s in round_summaries.items():
            if s["errors"]:
                print(f"{name} errors: {s['errors']}")
    result_verdict = _verdict(args, rounds)
    if result_verdict is not None:
        print("\n" + format_verdict(result_verdict))
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        doc: dict[str, Any] = {"args": vars(args), "workload": dataclasses.asdict(spec),
                               "environment": environment}
        if len(rounds) > 1:  # every round's summaries and requests
            doc["rounds"] = [{"order": r["order"], "summaries": r["summaries"],
                              "stated_slo_ms": r["stated_slo_ms"],
                              "requests": {n: _result_rows(x) for n, x in r["runs"].items()}}
                             for r in rounds]
        else:
            doc["summaries"] = summaries
            doc["requests"] = {n: _result_rows(r) for n, r in runs.items()}
        if len(rounds) == 1:
            doc["stated_slo_ms"] = rounds[0]["stated_slo_ms"]
        doc["verdict"] = result_verdict
        pathlib.Path(args.json).write_text(json.dumps(_finite(doc), indent=1, allow_nan=False))
    if args.plot:
        plot_cdfs(runs, args.plot)
    return 0 if all(s["failed"] == 0 for r in every_round for s in r.values()) else 1


def _in_setup_order(args: argparse.Namespace, summaries: dict[str, Any]) -> dict[str, Any]:
    """A round's summaries in --setups order (its columns stay put whatever the round's
    order)."""
    labels = [SETUPS[n][0] for n in args.setups]
    return {label: summaries[label] for label in labels if label in summaries}


def _verdict(args: argparse.Namespace, rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """--ratio-of's goodput over the best other set-up in each round (and its TPOT p99
    against --tpot-reference's); None when the run has no subject."""
    subject = args.ratio_of or (STATES_SLO if STATES_SLO in args.setups else None)
    if not rounds or subject is None or len(args.setups) < 2:
        return None
    reference = args.tpot_reference or ("pd" if "pd" in args.setups else None)
    for name in (subject, reference):
        if name is not None and name not in args.setups:
            raise SystemExit(f"{name!r} is not one of --setups {args.setups}")
    return verdict([r["summaries"] for r in rounds], SETUPS[subject][0],
                   None if reference in (None, subject) else SETUPS[reference][0])


def _finite(o: Any) -> Any:
    """nan/inf -> None, recursively, so the JSON is strict."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
