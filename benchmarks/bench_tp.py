"""Engine throughput with tensor parallelism: TP 1 against TP 2 on the same machine.

    python benchmarks/bench_tp.py [--model tiny-25m] [--concurrency 1 16] [--repeat 3]

Workload: ``c`` prompts of ``--prompt-len`` random token ids, each generating ``--gen-len``
tokens greedily (EOS ignored), sent at once over HTTP (non-streaming) to an engine
process (``python -m xllm_py.engine``, prefix cache off so repeats recompute). Three
engines, all started first and driven in turn within every repeat (the machine is
shared: a drift between repeats cancels out of the paired ratio of back-to-back runs):

* ``tp1-all``: TP 1, one torch thread per core (a TP 1 engine's default);
* ``tp1-1t``: TP 1, one thread;
* ``tp2``: ``--tensor-parallel-size 2``, one thread per rank (two processes joined by gloo
  over loopback; the fused native decode path is off at TP > 1).

Tokens/s = generated tokens / wall time; the median over repeats and the median of the
paired ratio tp2 / tp1-all are printed.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (engine_process, get_model_id, median,  # noqa: E402
                               random_token_prompts, run_load, summarize_load)


def rate(url: str, model: str, prompts: list[list[int]], gen_len: int) -> float:
    """Generated tokens/s of one batch sent at once."""
    results, wall = asyncio.run(run_load(url, model, prompts, gen_len, len(prompts)))
    summary = summarize_load(results, wall)
    if summary["num_failed"]:
        raise RuntimeError(f"{summary['num_failed']} requests failed: {summary.get('first_error')}")
    return summary["output_tokens_per_s"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-25m")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    cores = os.cpu_count() or 1
    configs = {"tp1-all": (1, cores), "tp1-1t": (1, 1), "tp2": (2, 1)}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(engine_process(
                    args.model, num_threads=threads, extra_args=["--tensor-parallel-size", str(tp)],
                    settings={"enable_prefix_cache": False, "num_threads": threads})).http_url
                for name, (tp, threads) in configs.items()}
        model = asyncio.run(get_model_id(urls["tp1-all"]))
        vocab = 1024 if args.model.startswith("tiny") else 32000
        print(f"model {args.model}, {args.prompt_len} prompt + {args.gen_len} generated "
              f"tokens, {cores} cores, median of {args.repeat}")
        print(f"{'concurrency':>11} " + " ".join(f"{n:>10}" for n in configs)
              + f" {'tp2/tp1-all (paired)':>21}")
        for c in args.concurrency:
            prompts = random_token_prompts(c, args.prompt_len, vocab, seed=c)
            for url in urls.values():  # warm-up
                rate(url, model, prompts[:1], 4)
            rates: dict[str, list[float]] = {n: [] for n in configs}
            for _ in range(args.repeat):
                for name, url in urls.items():
                    rates[name].append(rate(url, model, prompts, args.gen_len))
            paired = median([b / a for a, b in zip(rates["tp1-all"], rates["tp2"])])
            print(f"{c:>11} " + " ".join(f"{median(rates[n]):>10.1f}" for n in configs)
                  + f" {paired:>21.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
