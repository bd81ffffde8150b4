"""`python -m xllm_py.sim.validate [engine flags]`: the simulated engine against the real
engine its time model was fitted to, on one workload, in this process.

Stages: build the real engine -> profile it (profile.measure: other workloads) and fit
the time model -> the workload on a real engine and on a simulated one (spending its
modelled CPU time, --burn-cpu) in turn,
--trials times (the machine's load drifts) -> per run: mean TTFT, mean TPOT, makespan ->
the simulator's error: the median of its runs against the median of the real runs; and
the time model against the CPU time of the steps the real engine ran (profile.py: the
model is fitted to CPU time, which the machine's other load does not inflate; the real
engine's wall times are inflated by the share of a core it does not get).
Workload: --num-requests prompts of --input-len random tokens, --output-len tokens each,
at most --concurrency in flight (a new one as one finishes), after a warm-up of
--concurrency other prompts on the same engine.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import statistics
import sys
import tempfile

from xllm_py.engine.cli import build_parser as engine_parser, config_from_args
from xllm_py.sim.profile import cpu_model, measure, run_workload, timed_engine
from xllm_py.sim.time_model import fit

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xllm_py.sim.validate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="profile.measure: requests per "
                   "workload / in flight")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--burn-cpu", type=lambda v: v.lower() in ("1", "true", "yes"),
                   default=True, help="the simulator spends its modelled step time on the "
                   "CPU instead of sleeping, so that it waits for a shared core as the real "
                   "engine does (true/false)")
    p.add_argument("--json", default=None)
    args, rest = p.parse_known_args(argv)
    logging.basicConfig(level=logging.WARNING)
    config = config_from_args(engine_parser().parse_args(rest))
    from xllm_py.engine.engine_request import resolve_model_dir
    from xllm_py.model.config import ModelConfig
    from xllm_py.sim.engine import SimulatedEngine

    model = fit(measure(config, args.rounds), {"model": config.model, "cpu": cpu_model()})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(model.to_json())
    rng = random.Random(0)
    model_dir = resolve_model_dir(config.model)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompts = [[rng.randrange(16, vocab) for _ in range(args.input_len)]
               for _ in range(args.num_requests)]
    # Real and simulated runs interleaved, --trials times (the machine's load drifts),
    # each on a fresh engine (one that ran the prompts would serve them from its prefix
    # cache), after a warm-up; the medians compared.
    trials: dict[str, list[dict[str, float]]] = {"real": [], "simulated": []}
    for t in range(args.trials):
        for name in ("real", "simulated"):
            timer = None
            if name == "real":
                engine, timer = timed_engine(config)
            else:
                engine = SimulatedEngine(dataclasses.replace(config, simulate=f.name,
                                                             model=model_dir), args.burn_cpu)
            engine.start()
            warmup = [[rng.randrange(16, vocab) for _ in range(args.input_len)]
                      for _ in range(args.concurrency)]  # (a fresh engine's first steps)
            run_workload(engine, warmup, args.output_len, args.concurrency)
            if timer is not None:
                timer.on = True
            steps = timer.steps if timer is not None else []
            run = run_workload(engine, prompts, args.output_len, args.concurrency)
            engine.stop()
            if steps:  # the time model on the very steps the real engine ran
                cpu = sum(st.cpu_ms for st in steps)
                run["step_model_error"] = sum(model.step_ms(st.shape) for st in steps) / cpu - 1
                run["engine_cpu_share"] = cpu / sum(st.wall_ms for st in steps)
            trials[name].append(run)
            print(f"trial {t} {name:>9}: " + ", ".join(f"{k} {v:.2f}" for k, v in run.items()),
                  flush=True)
    keys = ("ttft_ms", "tpot_ms", "makespan_s")
    runs = {name: {k: statistics.median(r[k] for r in rs) for k in keys}
            for name, rs in trials.items()}
    error = {k: (runs["simulated"][k] - runs["real"][k]) / runs["real"][k] for k in keys}
    print("simulated vs real (medians of the trials): "
          + ", ".join(f"{k} {v:+.1%}" for k, v in error.items()))
    real_steps = {k: statistics.median(r[k] for r in trials["real"])
                  for k in ("step_model_error", "engine_cpu_share")}
    print(f"time model on the real engine's own steps: {real_steps['step_model_error']:+.1%} "
          f"of their CPU time; the real engine thread had {real_steps['engine_cpu_share']:.0%}"
          " of a core while stepping (the rest: waiting for one on this shared machine)")
    error["step_model_error"] = real_steps["step_model_error"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "trials": trials, "error": error, "args": vars(args),
                       "time_model": dataclasses.asdict(model)}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
