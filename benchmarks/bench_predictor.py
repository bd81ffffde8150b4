"""How far SLO_AWARE's predictions (xllm_service/pd_decision.py over a LatencyProfile) are
from what an engine on this machine does.

Stages: build the real engine from the engine flags that follow -> its latency profile:
--profile (the JSON of `python -m xllm_py.sim.profile`), else the one an engine measures
at start-up (xllm_py/engine/self_profile.py, as a PREFILL / DECODE in a cluster does) -> for each case (B background streams
decoding, then one probe prompt of U tokens): start the B streams, wait until each has a
token, submit the probe; measure its TTFT and TPOT (wall clock) and the process's CPU
time over the probe's life -> the prediction for the same state, as the service makes it
(`SloPredictor`'s formulas: the probe prefilled on an instance decoding B streams, then
decoding with B + 1) -> table of measured vs predicted and the relative errors, raw and
after the service's correction (one measured/predicted factor per instance: here, for
each case, the median factor of the other cases); the versions and the load average.

    python benchmarks/bench_predictor.py --model tiny-25m --num-threads 1
    python -m xllm_py.sim.profile --out /tmp/profile.json --model tiny --num-threads 1
    python benchmarks/bench_predictor.py --profile /tmp/profile.json --model tiny \
        --num-threads 1 --json bench_out/predictor.json

The profile is fitted to CPU time per step; on a machine whose cores are shared the wall
clock runs slower than that by the share the engine does not get (printed: CPU/wall).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/...py` from a clone
    sys.path.insert(0, str(ROOT))

from benchmarks.common import report_environment  # noqa: E402
from xllm_py.cluster.latency_profile import LatencyProfile  # noqa: E402
from xllm_py.engine.cli import build_parser as engine_parser, config_from_args  # noqa: E402

CASES = ((128, 0), (512, 0), (1024, 0), (1920, 0), (128, 8), (512, 8), (1024, 8), (1920, 8),
         (128, 24), (1024, 24))
BACKGROUND_PROMPT = 256
PROBE_TOKENS = 32


class Sink:
    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.first: float | None = None
        self.done: float | None = None
        self.tokens = 0
        self.event = threading.Event()
        self.first_event = threading.Event()
        self.error = ""

    def emit(self, out) -> None:
        n = sum(len(c.token_ids) for c in out.outputs)
        if n and self.first is None:
            self.first = time.perf_counter()
            self.first_event.set()
        self.tokens += n
        if getattr(out, "error_message", ""):
            self.error = out.error_message
        if out.finished:
            self.done = time.perf_counter()
            self.event.set()


def run_case(engine, profile: LatencyProfile, prompt_len: int, background: int,
             rng: random.Random, vocab: int) -> dict:
    from xllm_py.engine.llm_engine import EngineRequest
    from xllm_py.sampling_params import SamplingParams

    def prompt(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    bg_params = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)
    bg = []
    for i in range(background):
        sink = Sink()
        rid = f"bg-{time.monotonic_ns()}-{i}"
        engine.submit(EngineRequest(rid, prompt(BACKGROUND_PROMPT), bg_params, sink))
        bg.append((rid, sink))
    for _, sink in bg:
        sink.first_event.wait(120)
    ctx = sum(BACKGROUND_PROMPT + s.tokens for _, s in bg)
    params = SamplingParams(max_tokens=PROBE_TOKENS, min_tokens=PROBE_TOKENS,
                            temperature=0.0, ignore_eos=True)
    probe = Sink()
    cpu0 = _engine_cpu()
    engine.submit(EngineRequest(f"probe-{time.monotonic_ns()}", prompt(prompt_len), params, probe))
    probe.event.wait(600)
    cpu = _engine_cpu() - cpu0
    for rid, _ in bg:
        engine.abort(rid)
    if probe.first is None or probe.done is None:
        raise RuntimeError(f"the probe of {prompt_len} tokens got no output: {probe.error}")
    ttft = (probe.first - probe.sent) * 1000
    tpot = (probe.done - probe.first) * 1000 / max(1, probe.tokens - 1)
    wall = (probe.done - probe.sent) * 1000
    pred_ttft = profile.prefill_ms(prompt_len, background, ctx)
    pred_tpot = profile.decode_step_ms(background + 1, ctx + prompt_len + PROBE_TOKENS // 2)
    return {"prompt": prompt_len, "background": background, "ttft_ms": ttft,
            "pred_ttft_ms": pred_ttft, "tpot_ms": tpot, "pred_tpot_ms": pred_tpot,
            "cpu_share": cpu * 1000 / wall if wall else 0.0}


def _engine_cpu() -> float:
    """CPU seconds of this process (the engine thread does nearly all of it)."""
    return time.process_time()


def rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_predictor.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=None,
                   help="latency profile JSON (default: measured at start-up, as an engine "
                        "in a cluster does)")
    p.add_argument("--json", default=None, help="write the rows and errors here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None,
                   help="the engine's torch threads (its settings file's num_threads)")
    args, rest = p.parse_known_args(argv)
    engine_args = engine_parser().parse_args(rest)
    if args.num_threads is not None:
        engine_args.num_threads = args.num_threads
    config = config_from_args(engine_args)
    from xllm_py.engine.llm_engine import LLMEngine
    from xllm_py.engine.self_profile import measure_profile

    engine = LLMEngine(config)
    if args.profile:
        profile = LatencyProfile.from_dict(json.loads(open(args.profile).read()))
    else:
        t0 = time.perf_counter()
        profile = measure_profile(engine)
        print(f"profile measured at start-up in {time.perf_counter() - t0:.1f} s")
    profile = LatencyProfile(**{**profile.to_dict(), "max_num_batched_tokens":
                                config.scheduler.max_num_batched_tokens})
    engine.start()
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    try:
        run_case(engine, profile, 128, 2, rng, vocab)  # warm-up
        rows = [run_case(engine, profile, u, b, rng, vocab) for u, b in CASES]
    finally:
        engine.stop()
    env = report_environment()
    print(f"load average {os.getloadavg()}; model {config.model}, profile "
          f"{args.profile or 'measured at start-up'}")
    print(f"{'prompt':>6} {'bg':>3} {'TTFT ms':>9} {'pred':>8} {'err':>6} "
          f"{'TPOT ms':>8} {'pred':>7} {'err':>6} {'cpu/wall':>8}")
    for r in rows:
        print(f"{r['prompt']:>6} {r['background']:>3} {r['ttft_ms']:>9.1f} "
              f"{r['pred_ttft_ms']:>8.1f} {rel(r['pred_ttft_ms'], r['ttft_ms']):>+6.0%} "
              f"{r['tpot_ms']:>8.2f} {r['pred_tpot_ms']:>7.2f} "
              f"{rel(r['pred_tpot_ms'], r['tpot_ms']):>+6.0%} {r['cpu_share']:>8.2f}")
    # What the service does on top (SloPredictor.observe): one measured/predicted factor
    # per instance. Here leave-one-out: each case scaled by the median factor of the others.
    def corrected(key: str) -> list[float]:
        out = []
        for i, r in enumerate(rows):
            others = [o[key] / o["pred_" + key] for j, o in enumerate(rows) if j != i]
            out.append(abs(rel(r["pred_" + key] * statistics.median(others), r[key])))
        return out

    errs = {"ttft_corrected_median_abs_rel_err": statistics.median(corrected("ttft_ms")),
            "tpot_corrected_median_abs_rel_err": statistics.median(corrected("tpot_ms")),
            "ttft_median_abs_rel_err": statistics.median(
                abs(rel(r["pred_ttft_ms"], r["ttft_ms"])) for r in rows),
            "tpot_median_abs_rel_err": statistics.median(
                abs(rel(r["pred_tpot_ms"], r["tpot_ms"])) for r in rows),
            "cpu_share_median": statistics.median(r["cpu_share"] for r in rows)}
    print(" ".join(f"{k}={v:.2f}" for k, v in errs.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "load_average": os.getloadavg(), "rows": rows,
                       "errors": errs, "profile": profile.to_dict()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
