"""A prompt's prefill on one core, alone and beside a neighbour on the other core.

PD gives the prefill and the decode a core each, but the cores share the last-level cache
and the memory bus: a decode step streams every weight (tiny-25m: ~100 MB in float32) and
its KV. Issue 16's cluster computed long prompts 1.35-1.55x slower than the profile
measured alone predicts. This measures how much of that a neighbour's memory traffic
explains, as ratios against the same engine alone in the same run:

  engine (MIX, ``--model``, one torch thread, pinned to ``--core``, prompt budget
  ``--max-num-batched-tokens``) -> TTFT of ``--repeat`` prompts of each ``--lengths``
  (output 1 token): alone, then beside each neighbour, a process pinned to
  ``--other-core``: ``copy`` (a 200 MB tensor copied over and over: the memory bus),
  ``decode`` (a second engine decoding ``--streams`` streams of the same model: what a
  PD decode does) -> a table of median TTFT and its ratio to alone.

    python benchmarks/bench_prefill_interference.py
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/...py` from a clone
    sys.path.insert(0, str(ROOT))

from benchmarks.common import report_environment  # noqa: E402

NEIGHBOURS = ("copy", "decode")


def _engine(model: str, budget: int):
    from xllm_py.engine.cli import build_parser, config_from_args
    from xllm_py.engine.llm_engine import LLMEngine

    args = build_parser().parse_args(["--model", model, "--instance-role", "MIX",
                                      "--max-num-batched-tokens", str(budget)])
    args.num_threads = 1  # (the settings file's num_threads)
    return LLMEngine(config_from_args(args))


def neighbour(kind: str, core: int, model: str, streams: int) -> None:
    """Runs until killed, or until its parent (the measuring run) is gone: the load
    beside the measured engine."""
    parent = os.getppid()
    os.sched_setaffinity(0, {core})
    import torch

    torch.set_num_threads(1)
    if kind == "copy":
        a = torch.randn(50_000_000)
        b = torch.empty_like(a)
        print("ready", flush=True)
        while os.getppid() == parent:
            b.copy_(a)
        return
    from xllm_py.sim.profile import random_prompts, run_workload

    engine = _engine(model, 2048)
    engine.start()
    prompts = random_prompts(streams, 64, engine.model_config.vocab_size, random.Random(2))
    print("ready", flush=True)
    while os.getppid() == parent:  # streams of 500 tokens, over and over
        run_workload(engine, prompts, 500, streams)
    engine.stop()


def measure(engine, lengths: list[int], repeat: int, seed: int) -> dict[int, list[float]]:
    from xllm_py.sim.profile import random_prompts, run_workload

    rng, vocab = random.Random(seed), engine.model_config.vocab_size
    return {n: [run_workload(engine, random_prompts(1, n, vocab, rng), 1, 1)["ttft_ms"]
                for _ in range(repeat)] for n in lengths}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_prefill_interference.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-25m")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 1920])
    p.add_argument("--repeat", type=int, default=5, help="prompts of each length per case")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="the measured engine's step budget (the bench's prefill runs 512)")
    p.add_argument("--neighbours", nargs="*", choices=NEIGHBOURS, default=list(NEIGHBOURS),
                   help="neighbour cases after alone (none: alone only)")
    p.add_argument("--streams", type=int, default=8, help="decode neighbour: streams")
    p.add_argument("--core", type=int, default=0)
    p.add_argument("--other-core", type=int, default=1)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--neighbour", choices=NEIGHBOURS, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.neighbour:
        neighbour(args.neighbour, args.other_core, args.model, args.streams)
        return 0
    usable = os.sched_getaffinity(0)
    if args.core == args.other_core or not {args.core, args.other_core} <= usable:
        raise SystemExit(f"--core and --other-core must be two different cores of {usable}")
    result: dict = {"args": vars(args), "cases": {}}
    report_environment(result)
    os.sched_setaffinity(0, {args.core})
    engine = _engine(args.model, args.max_num_batched_tokens)
    engine.start()
    try:
        measure(engine, [128], 2, 0)  # warm-up
        # other prompts in every case: a repeated one would hit the prefix cache
        result["cases"]["alone"] = measure(engine, args.lengths, args.repeat, 1)
        for seed, kind in enumerate(args.neighbours, start=2):
            proc = subprocess.Popen([sys.executable, __file__, "--neighbour", kind,
                                     "--other-core", str(args.other_core), "--model",
                                     args.model, "--streams", str(args.streams)],
                                    stdout=subprocess.PIPE, text=True)
            try:
                if proc.stdout.readline().strip() != "ready":
                    raise SystemExit(f"the {kind} neighbour did not start")
                time.sleep(1.0)  # its first steps under way
                result["cases"][kind] = measure(engine, args.lengths, args.repeat, seed)
            finally:
                proc.kill()
                proc.wait()
    finally:
        engine.stop()
    alone = result["cases"]["alone"]
    print(f"\nprefill TTFT on core {args.core}, median of {args.repeat} (ms; x alone), "
          f"step budget {args.max_num_batched_tokens}:")
    print("case".ljust(10) + "".join(f"{n} tokens".rjust(20) for n in args.lengths))
    for case, times in result["cases"].items():
        cells = []
        for n in args.lengths:
            med = statistics.median(times[n])
            cells.append(f"{med:.0f} ({med / statistics.median(alone[n]):.2f}x)".rjust(20))
        print(case.ljust(10) + "".join(cells))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
