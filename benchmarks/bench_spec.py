"""Speculative decoding (n-gram prompt lookup) against none, on the served model.

    python benchmarks/bench_spec.py [--model gemma-3-270m] [--rounds 3] [--max-tokens 128]
                                    [--concurrency 1 4] [--threads N] [--json]

Two engine processes (``python -m xllm_py.engine``, MIX, prefix cache off so every round
computes its prompts again): ``--speculative-config off`` and ``'{"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'``, both up
at once and driven in turn (round r: off, then ngram, per set and concurrency), so a drift
of the shared machine's speed falls on both. Streamed ``/v1/completions``, greedy, EOS
ignored, ``--max-tokens`` each; four prompts per set, sent with at most ``c`` in flight.

Sets: ``repetitive``, output that repeats its prompt (rewrite a 40-line Python function with
one name changed; continue a list that repeats a pattern; quote a passage; extract a
passage's lines that name a place) and ``open``, open-ended text (stories, explanations).

Reported per set and concurrency: output tok/s and TPOT p50 (a request's time after its
first token over its tokens after the first) of each, the ngram / off ratio of each
(median over rounds of the round's ratio), and the mean acceptance length (tokens a verify
step emits per sequence: 1 + accepted / verifying sequence-steps, from the engine's
Prometheus counters). The greedy tokens of the two must be the same (``same_tokens``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import (engine_process, get_model_id, median,  # noqa: E402
                               report_environment, run_load)

NGRAM = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
         '"prompt_lookup_min": 2}')

_FUNCTION = '''def process_items(items, threshold=10, verbose=False):
    """Split items into small and large ones and count their kinds."""
    small = []
    large = []
    counts = {}
    for item in items:
        kind = item.get("kind", "unknown")
        counts[kind] = counts.get(kind, 0) + 1
        size = item.get("size", 0)
        if size < threshold:
            small.append(item)
        else:
            large.append(item)
        if verbose:
            print("item", item.get("name"), "of size", size)
    total = len(small) + len(large)
    if total == 0:
        return {"small": [], "large": [], "counts": {}, "ratio": 0.0}
    ratio = len(small) / total
    summary = {
        "small": small,
        "large": large,
        "counts": counts,
        "ratio": ratio,
    }
    if verbose:
        print("small:", len(small))
        print("large:", len(large))
        print("ratio:", round(ratio, 3))
    for kind, count in sorted(counts.items()):
        if count > total // 2:
            summary["dominant"] = kind
            break
    else:
        summary["dominant"] = None
    names = [item.get("name") for item in large]
    summary["large_names"] = sorted(n for n in names if n)
    summary["threshold"] = threshold
    return summary
'''

_PASSAGE = ("The old lighthouse stood on the northern cliff for two hundred years. Its keeper, "
            "a quiet man named Elias, climbed the spiral stairs every evening to light the "
            "lamp, and every morning he wrote the weather in a leather book. Ships from Bergen "
            "and Aberdeen passed below, and on clear nights their lights answered his. When "
            "the storm of 1871 broke the harbour wall, Elias kept the lamp burning for three "
            "days without sleep, and the fishing boats of Wick came home by its light.")

REPETITIVE = [
    f"```python\n{_FUNCTION}```\n\nThe same function with process_items renamed to "
    "handle_items, everything else unchanged:\n\n```python\n",
    "Shopping list:\n" + "".join(f"- {n} apples\n- {n} pears\n- {n} plums\n" for n in range(1, 5))
    + "- 5 apples\n",
    f"Passage:\n{_PASSAGE}\n\nQuote the passage word for word:\n\"",
    f"Passage:\n{_PASSAGE}\n\nThe passage again, one sentence a line:\n",
]
OPEN = [
    "Write a short story about a girl who finds a map in her grandfather's attic.",
    "Explain in simple words why the sky is blue and sunsets are red.",
    "The three most important inventions of the nineteenth century were",
    "Dear diary, today was the strangest day of my life. It started when",
]
SETS = {"repetitive": REPETITIVE, "open": OPEN}


def tpot_p50(results) -> float:
    values = [(r.latency_s - r.ttft_s) / (r.num_completion_tokens - 1) for r in results
              if r.ok and r.ttft_s is not None and r.num_completion_tokens > 1]
    return median(values)


def spec_counters(url: str) -> tuple[float, float]:
    """(accepted tokens, verifying sequence-steps) of the engine's counters."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    out = []
    for name in ("xllm_spec_decode_accepted_tokens_total", "xllm_spec_decode_verify_steps_total"):
        m = re.search(rf'^{name}\{{method="ngram"\}} ([0-9.e+]+)$', text, re.M)
        out.append(float(m.group(1)) if m else 0.0)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    common = {"enable_prefix_cache": False, "batch_window_ms": 0}
    with engine_process(args.model, num_threads=args.threads,
                        settings={**common, "speculative_config": "off"}) as off, \
            engine_process(args.model, num_threads=args.threads,
                           settings={**common, "speculative_config": NGRAM}) as on:
        servers = {"off": off.http_url, "ngram": on.http_url}
        model = asyncio.run(get_model_id(off.http_url))

        def load(url: str, prompts: list[str], c: int):
            return asyncio.run(run_load(url, model, prompts, args.max_tokens, c, stream=True,
                                        return_token_ids=True))

        for url in servers.values():  # warm-up (kernels, first steps)
            load(url, OPEN[:2], 2)
        cells: dict = {}
        for r in range(args.rounds):
            for set_name, prompts in SETS.items():
                for c in args.concurrency:
                    cell = cells.setdefault(f"{set_name} c={c}", {
                        "tok_s": {k: [] for k in servers}, "tpot_ms": {k: [] for k in servers},
                        "tokens": {}, "accept": []})
                    for name, url in servers.items():
                        before = spec_counters(url) if name == "ngram" else None
                        results, wall = load(url, prompts, c)
                        bad = [x.error for x in results if not x.ok]
                        if bad:
                            raise SystemExit(f"{name} {set_name} c={c}: {bad[0]}")
                        gen = sum(x.num_completion_tokens for x in results)
                        cell["tok_s"][name].append(gen / wall)
                        cell["tpot_ms"][name].append(1000 * tpot_p50(results))
                        cell["tokens"].setdefault(name, [x.token_ids for x in results])
                        if before is not None:
                            after = spec_counters(url)
                            steps = after[1] - before[1]
                            cell["accept"].append(1 + (after[0] - before[0]) / steps if steps else 1.0)
                    print(f"round {r + 1} {set_name} c={c}: "
                          + ", ".join(f"{k} {cell['tok_s'][k][-1]:.1f} tok/s" for k in servers),
                          file=sys.stderr)
    rows = {}
    for key, cell in cells.items():
        t, p = cell["tok_s"], cell["tpot_ms"]
        rows[key] = {
            "off_tok_s": median(t["off"]), "ngram_tok_s": median(t["ngram"]),
            "tok_s_ratio": median([b / a for a, b in zip(t["off"], t["ngram"])]),
            "off_tpot_ms": median(p["off"]), "ngram_tpot_ms": median(p["ngram"]),
            "tpot_ratio": median([b / a for a, b in zip(p["off"], p["ngram"])]),
            "acceptance_length": median(cell["accept"]),
            "same_tokens": cell["tokens"]["off"] == cell["tokens"]["ngram"],
        }
    result = {"model": args.model, "rounds": args.rounds, "max_tokens": args.max_tokens,
              "rows": rows}
    report_environment(result, file=sys.stderr if args.json else None)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'set':<16}{'off tok/s':>10}{'ngram':>8}{'ratio':>7}{'TPOT off':>10}{'ngram':>8}"
          f"{'ratio':>7}{'accept':>8}  same")
    for key, row in rows.items():
        print(f"{key:<16}{row['off_tok_s']:>10.1f}{row['ngram_tok_s']:>8.1f}"
              f"{row['tok_s_ratio']:>7.2f}{row['off_tpot_ms']:>10.2f}{row['ngram_tpot_ms']:>8.2f}"
              f"{row['tpot_ratio']:>7.2f}{row['acceptance_length']:>8.2f}  {row['same_tokens']}")


if __name__ == "__main__":
    main()
