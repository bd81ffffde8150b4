"""`python -m xllm_py.sim.validate [engine flags]`: the simulated engine against the real
engine its time model was fitted to, on one workload, in this process.

Stages: build the real engine -> profile it (profile.measure) and fit the time model ->
the workload on the real engine, on the simulated one, on a second real one (the two
real runs bracket the simulated one: the machine's load may drift) -> per run: mean
TTFT, mean TPOT, makespan -> the simulator's error against the mean of the real runs.
Workload: --num-requests prompts of --input-len random tokens, --output-len tokens each,
at most --concurrency in flight (a new one as one finishes).
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
import threading
import time

from xllm_py.engine.cli import build_parser as engine_parser, config_from_args
from xllm_py.sim.profile import cpu_model, measure
from xllm_py.sim.time_model import fit

logger = logging.getLogger(__name__)


class _Sink:
    def __init__(self, on_done) -> None:
        self.sent = time.monotonic()
        self.first: float | None = None
        self.tokens = 0
        self._on_done = on_done

    def emit(self, out) -> None:
        n = sum(len(c.token_ids) for c in out.outputs)
        if n and self.first is None:
            self.first = time.monotonic()
        self.tokens += n
        if out.finished:
            self.done = time.monotonic()
            self._on_done()


def run_workload(engine, prompts: list[list[int]], output_len: int,
                 concurrency: int) -> dict[str, float]:
    from xllm_py.engine.llm_engine import EngineRequest
    from xllm_py.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0.0,
                            ignore_eos=True)
    slots = threading.Semaphore(concurrency)
    sinks: list[_Sink] = []
    t0 = time.monotonic()
    for i, prompt in enumerate(prompts):
        slots.acquire()
        sink = _Sink(slots.release)
        sinks.append(sink)
        engine.submit(EngineRequest(f"v{i}", prompt, params, sink))
    for _ in range(concurrency):
        slots.acquire()
    end = max(s.done for s in sinks)
    return {"ttft_ms": statistics.mean((s.first - s.sent) * 1000 for s in sinks),
            "tpot_ms": statistics.mean((s.done - s.first) * 1000 / (s.tokens - 1) for s in sinks),
            "makespan_s": end - t0,
            "tokens": sum(s.tokens for s in sinks)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xllm_py.sim.validate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7, help="profiling runs per step shape")
    p.add_argument("--json", default=None)
    args, rest = p.parse_known_args(argv)
    logging.basicConfig(level=logging.WARNING)
    config = config_from_args(engine_parser().parse_args(rest))
    from xllm_py.engine.llm_engine import LLMEngine
    from xllm_py.sim.engine import SimulatedEngine

    real = LLMEngine(config)
    model = fit(measure(real, args.repeats), {"model": config.model, "cpu": cpu_model()})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(model.to_json())
    sim = SimulatedEngine(dataclasses.replace(config, simulate=f.name,
                                              model=real.model_dir))
    rng = random.Random(0)
    vocab = real.model_config.vocab_size
    prompts = [[rng.randrange(16, vocab) for _ in range(args.input_len)]
               for _ in range(args.num_requests)]
    runs = {}
    # Fresh engines for each run (the prefix cache of an engine that ran the prompts
    # would serve them again).
    for name, make in (("real", lambda: real), ("simulated", lambda: sim),
                       ("real again", lambda: LLMEngine(config))):
        engine = make()
        engine.start()
        runs[name] = run_workload(engine, prompts, args.output_len, args.concurrency)
        engine.stop()
        print(f"{name:>10}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[name].items()),
              flush=True)
    error = {}
    for key in ("ttft_ms", "tpot_ms", "makespan_s"):
        ref = (runs["real"][key] + runs["real again"][key]) / 2
        error[key] = (runs["simulated"][key] - ref) / ref
    print("simulated vs real (mean of both real runs): "
          + ", ".join(f"{k} {v:+.1%}" for k, v in error.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "error": error, "args": vars(args),
                       "time_model": dataclasses.asdict(model)}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
