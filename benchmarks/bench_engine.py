"""Engine throughput against transformers ``generate`` on the same weights (issue 3).

    python benchmarks/bench_engine.py [--quick] [--json] [--threads 1] [--repeat 5]
                                      [--concurrency 1 32] [--profile]
                                      [--model tiny-25m | tiny-25m-bf16 | DIR]

Workload: ``c`` prompts of exactly ``--prompt-len`` random token ids (64), each generating
``--gen-len`` tokens (64) greedily with EOS ignored, sent at once (c = 1 and 32).

* engine: ``python -m xllm_py.engine --instance-role MIX --model tiny-25m`` as a subprocess
  on a free loopback port (prefix cache off, so repeats recompute), driven over HTTP by
  the non-streaming client of ``benchmarks/common.py``;
* HF: ``AutoModelForCausalLM.from_pretrained`` on the directory ``ensure_tiny_model``
  returns, float32, ``torch.inference_mode``, ``generate(do_sample=False,
  min_new_tokens=max_new_tokens=gen_len)`` on the static batch (left padding; all
  prompts have the same length so there is none).

``--model tiny-25m-bf16``: the same model stored in bfloat16, as real checkpoints are. HF
runs it in float32 (upcast on load, exact); the engine computes in float32 too but keeps
its linear weights as bfloat16 panels (``pack_linears``' ``auto``: exact for
bfloat16-valued weights), half the bytes streamed per decode step. The greedy tokens must
match HF's all the same (``greedy==HF``), and the matmul floors are also given with
bfloat16 panels, at one row and at the largest concurrency.

Load: run it on an otherwise idle machine and quote the ``ran with`` line (its load
average). On the 2-core VM, HF ``generate`` (2 OpenMP threads, many small parallel regions
per token) loses far more to other processes than the engine (one native parallel region
per decode step): tiny-25m at concurrency 1, same versions (torch 2.13.0, transformers
5.24.0), engine/HF was 1.02x idle (issue 16), 2.6x at a load average of 2.5 and 10-30x at
5-16, HF falling from 124 to 3-57 tok/s while the engine stayed at 50-190.

Tokens/s = generated tokens / wall time. Engine and HF runs alternate within every
repeat and the median over repeats is reported (the machine is shared), with the ratio of
the two medians and the median of each repeat's own engine/HF ("paired": the two runs of a
repeat are measured back to back, so a drift of the machine's speed between repeats,
often 20-30% here, cancels out of it).

Engine decode step at the largest concurrency: ``(T(gen_len) - T(1)) / (gen_len - 1)``
from two runs with the same prompts (the second one stops after the prefill), next to two
compute floors measured in this process on the same weights with the same thread count:
``matmul``: every Linear of the model once on a [c, in] input (the dense FLOPs of one
decode step, nothing else); ``hf_forward``: one forward of the bare HF model on a
[c, 1] batch with a prefilled cache of prompt_len tokens.

Threads: the engine process and this process both run torch with ``--threads`` intra-op
threads (default: all cores, what each side gets when deployed). They take turns (HF runs
while the engine idles), so each side has the machine to itself while it computes; the
HTTP client is idle while its non-streaming requests are served. ``--threads 1`` gives
the single-core comparison.

``--profile`` also runs the same workload in-process through ``LLMEngine`` and prints
the cProfile of the engine thread (top functions by own time).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import logging
import os
import pathlib
import pstats
import shlex
import sys
import threading
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import (engine_process, get_model_id, median,  # noqa: E402
                               process_cpu_seconds, random_token_prompts, report_environment,
                               run_load)

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- HF side
def load_hf(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], gen_len: int,
                pad_id: int) -> tuple[float, float, list[list[int]]]:
    """Static batch, greedy, left padded. Returns (wall s, CPU s, generated ids per row)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        t0, c0 = time.perf_counter(), time.process_time()
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=gen_len,
                             min_new_tokens=gen_len, pad_token_id=pad_id, eos_token_id=None,
                             temperature=None, top_p=None, top_k=None)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    gen = out[:, width:]
    if gen.shape[1] != gen_len:
        raise RuntimeError(f"HF generated {gen.shape[1]} tokens, expected {gen_len}")
    return wall, cpu, gen.tolist()


def _time_best(fn, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def matmul_floor_s(model: torch.nn.Module, batch: int, iters: int) -> float:
    """Every Linear of the model (lm_head included) once on a [batch, in] input."""
    weights = [(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w, _ in weights}

    def one_pass() -> None:
        for w, b in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w, b)

    with torch.inference_mode():
        return _time_best(one_pass, iters)


def packed_matmul_floor_s(model: torch.nn.Module, batch: int, iters: int,
                          weight_dtype: torch.dtype = torch.float32) -> float:
    """The same Linears with weights packed as the engine runs them on CPU (panels in
    ``weight_dtype`` with the native kernels, else oneDNN's layout)."""
    from xllm_py.model.packed import PackedLinear, packing_supported

    if not packing_supported(model)[0]:
        return float("nan")
    layers = [PackedLinear(m, weight_dtype=weight_dtype)
              for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {m.in_features: torch.randn(batch, m.in_features) for m in layers}

    def one_pass() -> None:
        for m in layers:
            m(xs[m.in_features])

    with torch.inference_mode():
        return _time_best(one_pass, iters)


def hf_forward_floor_s(model: torch.nn.Module, batch: int, prompt_len: int,
                       iters: int) -> float:
    """One forward of the bare HF model on [batch, 1] new tokens after a prefilled cache."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=g)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
        step_ids = ids[:, -1:]
        pos = torch.full((batch, 1), prompt_len, dtype=torch.long)
        mask = torch.ones(batch, prompt_len + 1, dtype=torch.long)

        def one_step() -> None:
            model(input_ids=step_ids, cache=cache, use_cache=True,
                  position_ids=pos, attention_mask=mask, logits_to_keep=1)
            cache.crop(-1)

        return _time_best(one_step, iters)


# ---------------------------------------------------------------------------- engine side
def engine_generate(proc: Any, model_id: str, prompts: list[list[int]],
                    gen_len: int) -> tuple[float, float, list[list[int]]]:
    """All prompts at once over HTTP. Returns (wall s, engine process CPU s, ids per row)."""
    c0 = process_cpu_seconds(proc.pid)
    results, wall = asyncio.run(run_load(proc.http_url, model_id, prompts, gen_len,
                                         concurrency=len(prompts), return_token_ids=True))
    cpu = process_cpu_seconds(proc.pid) - c0
    bad = [r for r in results if not r.ok or r.num_completion_tokens != gen_len]
    if bad:
        raise RuntimeError(f"{len(bad)} engine requests failed or were short: "
                           f"{bad[0].error or bad[0].num_completion_tokens}")
    return wall, cpu, [r.token_ids or [] for r in results]


def profile_engine(model: str, prompts: list[list[int]], gen_len: int,
                   top: int = 25) -> str:
    """The same workload through an in-process LLMEngine; cProfile of the engine thread."""
    from xllm_py.config import CacheConfig, EngineConfig
    from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
    from xllm_py.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, cache=CacheConfig(enable_prefix_caching=False)))
    engine.start()
    try:
        def run(tag: str) -> float:
            done = threading.Semaphore(0)

            class Sink:
                def emit(self, output: Any) -> None:
                    if output.finished:
                        done.release()

            params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                engine.submit(EngineRequest(f"{tag}-{i}", list(p), params, Sink()))
            for _ in prompts:
                done.acquire()
            return time.perf_counter() - t0

        run("warmup")
        prof = cProfile.Profile()
        engine.call(prof.enable).result()  # on the engine thread
        steps0 = engine.num_steps
        wall = run("profiled")
        engine.call(prof.disable).result()
        steps = engine.num_steps - steps0
    finally:
        engine.stop()
    buf = io.StringIO()
    buf.write(f"in-process engine: {len(prompts)} x {gen_len} tokens in {wall:.2f}s, "
              f"{steps} steps, {wall / max(steps, 1) * 1e3:.1f} ms/step (under cProfile)\n")
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-25m")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads, both sides (default: all cores)")
    p.add_argument("--repeat", type=int, default=None, help="runs per side (default 5, quick 1)")
    p.add_argument("--quick", action="store_true", help="one repeat, fewer floor iterations")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--engine-args", default="",
                   help="extra engine flags, one string (e.g. '--max-num-batched-tokens 512')")
    p.add_argument("--profile", action="store_true",
                   help="also cProfile an in-process engine at the largest concurrency")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    repeat = args.repeat or (1 if args.quick else 5)
    floor_iters = 5 if args.quick else 20
    torch.set_num_threads(args.threads)

    from xllm_py.model.packed import is_bfloat16_valued
    from xllm_py.model.tiny import ensure_tiny_model

    model_dir = str(ensure_tiny_model(args.model)) if args.model.startswith("tiny") else args.model
    hf = load_hf(model_dir)
    vocab = int(hf.config.vocab_size)
    pad_id = 0
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))

    result: dict[str, Any] = {
        "model": args.model, "checkpoint_dtype": _checkpoint_dtype(model_dir),
        # the engine's pack_linears(auto) keeps such weights as bfloat16 panels
        "bf16_weights": all(is_bfloat16_valued(m.weight) for m in hf.modules()
                            if isinstance(m, torch.nn.Linear)),
        "prompt_len": args.prompt_len, "gen_len": args.gen_len,
        "threads": args.threads, "repeat": repeat, "torch": torch.__version__,
        "cpu_count": os.cpu_count(), "concurrency": {},
    }
    report_environment(result, file=sys.stderr if args.json else sys.stdout)
    engine_flags = ["--log-level", "WARNING", "--max-num-seqs", str(max(64, max(args.concurrency)))]
    engine_flags += shlex.split(args.engine_args)
    with engine_process(args.model, num_threads=args.threads, extra_args=engine_flags,
                        settings={"enable_prefix_cache": False}) as proc:
        model_id = asyncio.run(get_model_id(proc.http_url))
        warm = random_token_prompts(2, args.prompt_len, vocab, seed=999)
        engine_generate(proc, model_id, warm, 4)
        hf_generate(hf, warm, 4, pad_id)
        for c in args.concurrency:
            prompts = random_token_prompts(c, args.prompt_len, vocab, seed=c)
            eng_t, hf_t, eng_t1, eng_cpu, hf_cpu = [], [], [], [], []
            eng_ids = hf_ids = None
            for r in range(repeat):
                wall, cpu, eng_ids = engine_generate(proc, model_id, prompts, args.gen_len)
                eng_t.append(wall)
                eng_cpu.append(cpu)
                wall, cpu, hf_ids = hf_generate(hf, prompts, args.gen_len, pad_id)
                hf_t.append(wall)
                hf_cpu.append(cpu)
                if c == max(args.concurrency):
                    eng_t1.append(engine_generate(proc, model_id, prompts, 1)[0])
                say(f"c={c} run {r}: engine {c * args.gen_len / eng_t[-1]:.1f} tok/s, "
                    f"HF {c * args.gen_len / hf_t[-1]:.1f} tok/s")
            gen = c * args.gen_len
            entry: dict[str, Any] = {
                "engine_tok_s": gen / median(eng_t), "hf_tok_s": gen / median(hf_t),
                "engine_wall_s": eng_t, "hf_wall_s": hf_t,
                "engine_cpu_s": eng_cpu, "hf_cpu_s": hf_cpu,
                # generated tokens per CPU second: steadier than wall time when shared
                "engine_tok_per_cpu_s": gen / median(eng_cpu),
                "hf_tok_per_cpu_s": gen / median(hf_cpu),
                "greedy_equal_seqs": sum(a == b for a, b in zip(eng_ids or [], hf_ids or [])),
            }
            entry["ratio"] = entry["engine_tok_s"] / entry["hf_tok_s"]
            # each run's engine / HF, the two measured back to back: the machine's speed
            # drifts between runs (shared host), much less within one pair
            entry["paired_ratios"] = [h / e for e, h in zip(eng_t, hf_t)]
            entry["paired_ratio"] = median(entry["paired_ratios"])
            entry["cpu_ratio"] = entry["engine_tok_per_cpu_s"] / entry["hf_tok_per_cpu_s"]
            if eng_t1:
                entry["engine_decode_step_ms"] = (
                    (median(eng_t) - median(eng_t1)) / (args.gen_len - 1) * 1e3)
                entry["engine_prefill_plus_1_ms"] = median(eng_t1) * 1e3
            result["concurrency"][str(c)] = entry
    c = max(args.concurrency)
    result["floor_batch"] = c
    result["floor_matmul_ms"] = matmul_floor_s(hf, c, floor_iters * 5) * 1e3
    result["floor_matmul_packed_ms"] = packed_matmul_floor_s(hf, c, floor_iters * 5) * 1e3
    if result["bf16_weights"]:  # what bfloat16 panels save, at one row and at c rows
        for rows in sorted({1, c}):
            result[f"floor_matmul_packed_rows{rows}_ms"] = {
                name: packed_matmul_floor_s(hf, rows, floor_iters * 5, dtype) * 1e3
                for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    result["floor_hf_forward_ms"] = hf_forward_floor_s(hf, c, args.prompt_len, floor_iters) * 1e3
    result["hf_decode_step_ms"] = median(result["concurrency"][str(c)]["hf_wall_s"]) \
        / args.gen_len * 1e3
    if args.profile:
        result["profile"] = profile_engine(
            args.model, random_token_prompts(c, args.prompt_len, vocab, seed=c), args.gen_len)

    if args.json:
        print(json.dumps(result))
        return 0
    print(f"\nmodel {args.model} (stored in {result['checkpoint_dtype']}; HF float32, engine "
          f"float32 with {'bfloat16' if result['bf16_weights'] else 'float32'} linear weights), "
          f"{args.prompt_len} prompt + {args.gen_len} generated tokens, "
          f"greedy, ignore_eos, {args.threads} torch thread(s) per process, "
          f"median of {repeat}")
    print(f"{'conc':>5} {'engine tok/s':>13} {'HF tok/s':>10} {'engine/HF':>10} {'paired':>7} "
          f"{'eng tok/cpu-s':>14} {'HF tok/cpu-s':>13} {'cpu ratio':>10} {'greedy==HF':>11}")
    for conc, e in result["concurrency"].items():
        print(f"{conc:>5} {e['engine_tok_s']:>13.1f} {e['hf_tok_s']:>10.1f} {e['ratio']:>9.2f}x "
              f"{e['paired_ratio']:>6.2f}x "
              f"{e['engine_tok_per_cpu_s']:>14.1f} {e['hf_tok_per_cpu_s']:>13.1f} "
              f"{e['cpu_ratio']:>9.2f}x {e['greedy_equal_seqs']:>6}/{conc}")
    print("engine/HF: ratio of the medians; paired: median of each run's engine/HF "
          "(measured back to back)")
    e = result["concurrency"][str(c)]
    if "engine_decode_step_ms" in e:
        step = e["engine_decode_step_ms"]
        print(f"\ndecode step at {c}: engine {step:.1f} ms, HF generate "
              f"{result['hf_decode_step_ms']:.1f} ms (incl. prefill share)")
        print(f"floors: matmul-only {result['floor_matmul_ms']:.1f} ms "
              f"(engine at {step / result['floor_matmul_ms']:.2f}x), matmul-only with "
              f"packed weights {result['floor_matmul_packed_ms']:.1f} ms (engine at "
              f"{step / result['floor_matmul_packed_ms']:.2f}x), bare HF forward "
              f"{result['floor_hf_forward_ms']:.1f} ms "
              f"(engine at {step / result['floor_hf_forward_ms']:.2f}x)")
    for rows in sorted({1, c}):
        f = result.get(f"floor_matmul_packed_rows{rows}_ms")
        if f:
            print(f"matmul-only, packed, {rows} row(s): float32 panels {f['float32']:.1f} ms, "
                  f"bfloat16 panels {f['bfloat16']:.1f} ms "
                  f"({f['bfloat16'] / f['float32']:.2f}x)")
    if args.profile:
        print("\n" + result["profile"])
    return 0


def _checkpoint_dtype(model_dir: str) -> str:
    """The dtype config.json gives for the stored weights."""
    try:
        cfg = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "unknown"
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "unknown")


if __name__ == "__main__":
    sys.exit(main())
