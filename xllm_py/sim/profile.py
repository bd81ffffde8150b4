"""`python -m xllm_py.sim.profile --out PROFILE.json [engine flags]`: measure a real
engine's step times and fit the simulator's TimeModel to them.

Stages: build the real engine (the same flags as `python -m xllm_py.engine`: --model,
--device, --dtype, --config ...; and --num-threads) -> time (engine-thread CPU) every step's forward
and sampling (the parts the simulator replaces; the scheduler and output processing run
for real in both)
while the engine serves workloads: prompts of 32..1536 random tokens, 1..16 requests in
flight, 32 tokens each, after a warm-up -> least-squares fit (time_model.fit) -> write the
JSON with the model, device and CPU it came from.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import random
import statistics
import sys
import threading
import time

from xllm_py.engine.cli import build_parser as engine_parser, config_from_args
from xllm_py.engine.llm_engine import LLMEngine
from xllm_py.engine.model_setup import LoadedModel, load_model
from xllm_py.sim.time_model import StepShape, fit
from xllm_py.utils.machine import cpu_model

logger = logging.getLogger(__name__)

# (prompt tokens, requests in flight) of the profiling workloads
WORKLOADS = ((32, 1), (128, 1), (512, 1), (1024, 1), (1536, 1), (32, 4), (128, 4), (512, 4),
             (32, 16), (128, 16), (256, 16))
OUTPUT_LEN = 32


class _Sink:
    def __init__(self, on_done) -> None:
        self.sent = time.monotonic()
        self.first: float | None = None
        self.done = 0.0
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
    """`prompts` through a started engine, at most `concurrency` in flight, each for
    exactly `output_len` tokens: mean TTFT, mean TPOT, makespan."""
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
        engine.submit(EngineRequest(f"w{time.monotonic_ns()}-{i}", prompt, params, sink))
    for _ in range(concurrency):
        slots.acquire()
    return {"ttft_ms": statistics.mean((s.first - s.sent) * 1000 for s in sinks),
            "tpot_ms": statistics.mean((s.done - s.first) * 1000 / max(1, s.tokens - 1)
                                       for s in sinks),
            "makespan_s": max(s.done for s in sinks) - t0,
            "tokens": sum(s.tokens for s in sinks)}


@dataclasses.dataclass
class StepTime:
    shape: StepShape
    cpu_ms: float  # the engine thread's CPU time: what the step costs on a core of its own
    wall_ms: float  # more on a machine whose cores are shared


class StepTimer:
    """The forward + sampling time of every step of an engine built on `timed(loaded)`,
    once `on` (timed on the engine thread; with torch's intra-op threads at 1, all of
    its compute): the parts of a step the simulator replaces."""

    def __init__(self) -> None:
        self.steps: list[StepTime] = []
        self.on = False

    def timed(self, loaded: LoadedModel) -> LoadedModel:
        return dataclasses.replace(loaded, runner=_TimedRunner(loaded.runner, self),
                                   sampler=_TimedSampler(loaded.sampler, self))


class _TimedRunner:
    def __init__(self, runner, timer: StepTimer) -> None:
        self.runner, self.timer = runner, timer

    def execute_step(self, seqs):
        c0, t0 = time.thread_time(), time.perf_counter()
        out = self.runner.execute_step(seqs)
        if self.timer.on:
            self.timer.steps.append(StepTime(StepShape.of(seqs), (time.thread_time() - c0) * 1000,
                                             (time.perf_counter() - t0) * 1000))
        return out


class _TimedSampler:
    def __init__(self, sampler, timer: StepTimer) -> None:
        self.sampler, self.timer = sampler, timer

    def __call__(self, *args):
        c0, t0 = time.thread_time(), time.perf_counter()
        out = self.sampler(*args)
        if self.timer.on and self.timer.steps:
            self.timer.steps[-1].cpu_ms += (time.thread_time() - c0) * 1000
            self.timer.steps[-1].wall_ms += (time.perf_counter() - t0) * 1000
        return out


def timed_engine(config) -> tuple[LLMEngine, StepTimer]:
    """A real engine of `config` whose steps a StepTimer times (once turned on)."""
    timer = StepTimer()
    return LLMEngine(config, timer.timed(load_model(config))), timer


def random_prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(n)]


def measure(config, rounds: int = 3) -> list[tuple[StepShape, float]]:
    """(shape, CPU ms) of the steps of a real engine of `config` serving WORKLOADS
    (`rounds` x concurrency requests each), after a warm-up; the engine is started and
    stopped here.
    CPU time, not wall time: on a shared machine the wall time of a step swings with the
    other processes (4x within minutes on the 2-core VM), its CPU time does not."""
    engine, timer = timed_engine(config)
    rng, vocab = random.Random(1), engine.model_config.vocab_size
    engine.start()
    try:
        run_workload(engine, random_prompts(8, 128, vocab, rng), OUTPUT_LEN, 8)  # warm-up
        timer.on = True
        steps = timer.steps
        for length, concurrency in WORKLOADS:
            run_workload(engine, random_prompts(rounds * concurrency, length, vocab, rng),
                         OUTPUT_LEN, concurrency)
            logger.info("profiled %d-token prompts x %d in flight: %d steps so far", length,
                        concurrency, len(steps))
    finally:
        engine.stop()
    return [(st.shape, st.cpu_ms) for st in steps]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xllm_py.sim.profile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where to write the profile (JSON)")
    p.add_argument("--rounds", type=int, default=3, help="requests per workload / in flight")
    p.add_argument("--num-threads", type=int, default=None,
                   help="the engine's torch threads (its settings file's num_threads)")
    args, rest = p.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    engine_args = engine_parser().parse_args(rest)
    if args.num_threads is not None:
        engine_args.num_threads = args.num_threads
    config = config_from_args(engine_args)
    samples = measure(config, args.rounds)
    import torch

    source = {"model": config.model, "device": config.device, "dtype": config.dtype,
              "num_threads": torch.get_num_threads(), "torch": torch.__version__,
              "python": platform.python_version(), "cpu": cpu_model(),
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "num_steps": len(samples)}
    model = fit(samples, source)
    model.save(args.out)
    total = sum(ms for _, ms in samples)
    print(json.dumps({k: v for k, v in dataclasses.asdict(model).items() if k != "source"}))
    print(f"wrote {args.out}: {len(samples)} steps, {total / 1000:.1f} s measured, modelled "
          f"{sum(model.step_ms(s) for s, _ in samples) / 1000:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
