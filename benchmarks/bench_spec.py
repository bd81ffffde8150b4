"""Speculative decoding (n-gram prompt lookup, suffix decoding, Predicted Outputs) against
none, on the served model.

    python benchmarks/bench_spec.py [--model gemma-3-270m] [--rounds 3] [--max-tokens 128]
                                    [--concurrency 1 4 16] [--sets repetitive open]
                                    [--methods ngram suffix prediction] [--prompts N]
                                    [--logprobs N] [--threads N] [--json]
                                    [--peers vllm vllm-ngram llama.cpp llama.cpp-ngram]

Engine processes (``python -m xllm_py.engine``, MIX, prefix cache off):
``--speculative-config off``, ``NGRAM`` below (the engine's default, ``SpeculativeConfig``
DEFAULT) and ``SUFFIX``, all up at once and driven in turn (off, then each method),
so a drift of the shared machine's speed falls on all. ``prediction``: the
engine without a method, each edit prompt sent with the text it edits as its
``prediction`` (OpenAI's Predicted Outputs; only in sets with such prompts). Streamed
``/v1/completions``, greedy, EOS ignored, ``--max-tokens`` each; the first ``--prompts``
prompts of a set (default four; at concurrency c at least c, a set's prompts taken again
when it has fewer), sent with at most ``c`` in flight; with ``--logprobs N``
each asks for its tokens' logprobs and the top N (verify rows give them too).

Sets: ``repetitive``, output that repeats its prompt (rewrite a 40-line Python function with
one name changed; continue a list that repeats a pattern; quote a passage; extract a
passage's lines that name a place) and ``open``, open-ended text (stories, explanations).

Reported per set, concurrency and method: output tok/s and TPOT p50 (a request's time after
its first token over its tokens after the first), the method / off ratio of each (median
over rounds of the round's ratio), and the mean acceptance length (tokens a verify step
emits per sequence: 1 + accepted / verifying sequence-steps, from the engine's Prometheus
counters), and the ratio's range over rounds. The greedy tokens of every method must be
off's (``same_tokens``). Every set, concurrency and round gets engines started afresh,
warmed up on prompts of no set: the suffix engine's cache holds no earlier answer to a
prompt it is measured on (a client repeating a request would see its answer replayed).

``--peers``: vLLM and llama.cpp's server (benchmarks/peer_servers.py, installed by
scripts/install_peers.sh) on the same weights, up for the whole run and driven in the same
turn, the same prompts as text; each with its speculation off, or (``-ngram``) with its
model-free n-gram lookup (``PEERS``). A peer row's ratio is its tok/s over off's, and
``default_vs_peer`` the engine default's over the peer's (median over rounds).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import sys
import tempfile

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import (engine_process, get_model_id, median,  # noqa: E402
                               report_environment, run_load)
from benchmarks.peer_models import peer_plan  # noqa: E402
from benchmarks.peer_servers import (Server, find_llama_server, find_vllm_python,  # noqa: E402
                                     server_command, skip_reason)

NGRAM = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
         '"prompt_lookup_min": 2}')
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 8}'
DEFAULT_METHOD = "ngram"  # NGRAM is the engine's default (speculative_config.py DEFAULT)

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
    "Describe how a bill becomes a law, step by step.",
    "What would happen if the moon disappeared tomorrow?",
    "Give advice to someone starting their first job as a nurse.",
    "The old lighthouse keeper looked out at the sea and",
    "List the pros and cons of living in a big city.",
    "Tell me about the history of chess in a few paragraphs.",
    "Once upon a time, in a village at the edge of a great forest,",
    "Why do cats purr? Answer like a veterinarian would.",
    "Write a letter to your future self, ten years from now.",
    "Summarize the plot of a detective novel you would like to write.",
    "How does a refrigerator keep food cold?",
    "The recipe my grandmother never wrote down goes like this:",
]
SETS = {"repetitive": REPETITIVE, "open": OPEN}
# warm-up (kernels, first steps), in no set: an engine's suffix cache starts without answers
WARMUP = ["The weather report for tomorrow:", "Three facts about volcanoes:"]
# Predicted Outputs: per prompt of a set, the text its answer edits (None: no prediction).
PREDICTIONS = {"repetitive": [_FUNCTION, None, _PASSAGE, _PASSAGE]}


def tpot_p50(results) -> float:
    values = [(r.latency_s - r.ttft_s) / (r.num_completion_tokens - 1) for r in results
              if r.ok and r.ttft_s is not None and r.num_completion_tokens > 1]
    return median(values)


def spec_counters(url: str, method: str) -> tuple[float, float]:
    """(accepted tokens, verifying sequence-steps) of the engine's counters of `method`."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    out = []
    for name in ("xllm_spec_decode_accepted_tokens_total", "xllm_spec_decode_verify_steps_total"):
        m = re.search(rf'^{name}\{{method="{method}"\}} ([0-9.e+]+)$', text, re.M)
        out.append(float(m.group(1)) if m else 0.0)
    return out[0], out[1]


def per_prompt(mode: str, set_name: str, n: int) -> list[dict] | None:
    """The request fields of each prompt in `mode` (prediction: each edit's text)."""
    if mode != "prediction":
        return None
    return [{"prediction": {"type": "content", "content": text}} if text else {}
            for text in cycled(PREDICTIONS[set_name], n)]


def cycled(items: list, n: int) -> list:
    """The first n of `items` repeated (a concurrency above a set's size sends each prompt
    again: prefix caching is off, so each copy is computed anew)."""
    return [items[i % len(items)] for i in range(n)]


# The peers, each a server and its extra arguments: speculation off, or their model-free
# n-gram lookup sized as NGRAM (a 2-4 token match; llama.cpp's takes one size: 3), 4 guesses.
PEERS = {
    "vllm": ("vllm", []),
    "vllm-ngram": ("vllm", ["--speculative-config", NGRAM]),
    "llama.cpp": ("llama.cpp", []),
    "llama.cpp-ngram": ("llama.cpp", ["--spec-type", "ngram-simple",
                                      "--spec-ngram-simple-size-n", "3",
                                      "--spec-ngram-simple-size-m", "4"]),
}


def start_peers(stack: contextlib.ExitStack, names: list[str], model: str,
                concurrency: int, slot_tokens: int) -> dict[str, Server]:
    """Each peer of ``names`` (PEERS) that is installed, started on ``model`` and ready
    (stopped when ``stack`` closes); a missing one is skipped with a message."""
    from xllm_py.utils.procs import free_port

    paths = {"vllm": find_vllm_python(None), "llama.cpp": find_llama_server(None)}
    vllm = any(PEERS[n][0] == "vllm" for n in names)
    plan = peer_plan(model, need_hf_dir=vllm and paths["vllm"] is not None)
    log_dir = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-spec-")))
    servers = {}
    for name in names:
        kind, extra = PEERS[name]
        why = skip_reason(kind, hf_dir=plan["hf_dir"] is not None, gguf=plan["gguf"] is not None,
                          vllm_python=paths["vllm"], llama_server=paths["llama.cpp"])
        if why:
            print(f"skipping {name}: {why}", file=sys.stderr)
            continue
        port = free_port()
        cmd = server_command(kind, plan, paths, port, slots=max(4, concurrency),
                             slot_tokens=slot_tokens)
        cmd = dataclasses.replace(cmd, name=name, argv=[*cmd.argv, *extra])
        server = Server(cmd, port, log_dir / f"{name}.log")
        stack.callback(server.stop)
        server.wait_ready()
        servers[name] = server
    return servers


def start_engines(stack: contextlib.ExitStack, args: argparse.Namespace
                  ) -> tuple[dict[str, str], str]:
    """The engines of ``args.methods`` up (off's serves ``prediction``): their URLs by
    method, and the model id they serve."""
    common = {"enable_prefix_cache": False, "batch_window_ms": 0}
    configs = {"off": "off", "ngram": NGRAM, "suffix": SUFFIX}
    urls = {name: stack.enter_context(engine_process(
                args.model, num_threads=args.threads,
                settings={**common, **({"speculative_config": configs[name]}
                                       if configs[name] else {})})).http_url
            for name in ["off", *[m for m in args.methods if m in configs]]}
    servers = {"off": urls["off"], **{m: urls.get(m, urls["off"]) for m in args.methods}}
    return servers, asyncio.run(get_model_id(urls["off"]))


def run_cell(cells: dict, r: int, set_name: str, c: int, servers: dict[str, str], model: str,
             peers: dict[str, Server], load, args: argparse.Namespace) -> None:
    """Round ``r`` of one set at concurrency ``c``: every mode in turn, into ``cells``."""
    modes = [m for m in servers if m != "prediction" or set_name in PREDICTIONS]
    prompts = cycled(SETS[set_name], max(args.prompts, c))
    cell = cells.setdefault(f"{set_name} c={c}", {
        "tok_s": {k: [] for k in modes}, "tpot_ms": {k: [] for k in modes},
        "tokens": {}, "accept": {k: [] for k in modes}})
    for name in modes:
        url = servers[name]
        counted = name not in peers
        before = spec_counters(url, name) if counted else (0.0, 0.0)
        results, wall = load(url, model, prompts, c, per_prompt(name, set_name, len(prompts)))
        bad = [x.error for x in results if not x.ok]
        if bad:
            raise SystemExit(f"{name} {set_name} c={c}: {bad[0]}")
        gen = sum(x.num_completion_tokens for x in results)
        cell["tok_s"][name].append(gen / wall)
        cell["tpot_ms"][name].append(1000 * tpot_p50(results))
        cell["tokens"].setdefault(name, [x.token_ids for x in results])
        after = spec_counters(url, name) if counted else (0.0, 0.0)
        steps = after[1] - before[1]
        cell["accept"][name].append(1 + (after[0] - before[0]) / steps if steps else 1.0)
    print(f"round {r + 1} {set_name} c={c}: "
          + ", ".join(f"{k} {cell['tok_s'][k][-1]:.1f} tok/s" for k in modes), file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS))
    ap.add_argument("--methods", nargs="+", choices=["ngram", "suffix", "prediction"],
                    default=["ngram", "suffix", "prediction"])
    ap.add_argument("--prompts", type=int, default=4, help="the first N prompts of each set")
    ap.add_argument("--logprobs", type=int, default=None, help="ask for logprobs, top N")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--peers", nargs="*", choices=list(PEERS), default=[],
                    help="race these peer servers on the same prompts")
    args = ap.parse_args()
    extra = {} if args.logprobs is None else {"logprobs": args.logprobs}
    with contextlib.ExitStack() as stack:
        peers = start_peers(stack, args.peers, args.model, max(args.concurrency),
                            slot_tokens=1024 + args.max_tokens)

        def load(url: str, model: str, prompts: list[str], c: int, fields=None):
            peer = next((p for p in peers.values() if p.url == url), None)
            if peer is not None:  # the text it sends back is all a peer is asked for
                return asyncio.run(run_load(url, peer.cmd.model_id, prompts, args.max_tokens, c,
                                            stream=True, keepalive=peer.cmd.keepalive, **extra))
            return asyncio.run(run_load(url, model, prompts, args.max_tokens, c, stream=True,
                                        return_token_ids=True, per_prompt=fields, **extra))

        for peer in peers.values():  # warm-up (first steps)
            load(peer.url, "", WARMUP, 2)
        cells: dict = {}
        for r in range(args.rounds):
            for set_name in args.sets:
                for c in args.concurrency:
                    with contextlib.ExitStack() as fresh:  # engines that have seen no answer
                        servers, model = start_engines(fresh, args)
                        for url in set(servers.values()):
                            load(url, model, WARMUP, 2)
                        servers.update({name: peer.url for name, peer in peers.items()})
                        run_cell(cells, r, set_name, c, servers, model, peers, load, args)
    rows = {}
    for key, cell in cells.items():
        t, p = cell["tok_s"], cell["tpot_ms"]
        row = {"off_tok_s": median(t["off"]), "off_tpot_ms": median(p["off"])}
        default = DEFAULT_METHOD if DEFAULT_METHOD in t else "off"
        for m in [k for k in t if k != "off"]:
            row[m] = {
                "tok_s": median(t[m]), "tok_s_ratio": median([b / a for a, b in zip(t["off"], t[m])]),
                "ratio_range": (min(b / a for a, b in zip(t["off"], t[m])),
                                max(b / a for a, b in zip(t["off"], t[m]))),
                "tpot_ms": median(p[m]), "tpot_ratio": median([b / a for a, b in zip(p["off"], p[m])]),
                "acceptance_length": median(cell["accept"][m]),
                "same_tokens": cell["tokens"]["off"] == cell["tokens"][m]}
            if m in peers:  # a peer's tokens are its own (other kernels, other rounding)
                row[m].update(acceptance_length=None, same_tokens=None, default_vs_peer=median(
                    [a / b for a, b in zip(t[default], t[m])]))
        rows[key] = row
    result = {"model": args.model, "rounds": args.rounds, "max_tokens": args.max_tokens,
              "prompts": args.prompts, "logprobs": args.logprobs, "rows": rows}
    report_environment(result, file=sys.stderr if args.json else None)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'set':<16}{'method':<16}{'tok/s':>8}{'ratio':>7}{'min-max':>11}{'TPOT ms':>9}"
          f"{'ratio':>7}{'accept':>8}  same")
    for key, row in rows.items():
        print(f"{key:<16}{'off':<16}{row['off_tok_s']:>8.1f}{'':>7}{'':>11}{row['off_tpot_ms']:>9.2f}")
        for m, v in row.items():
            if isinstance(v, dict):
                accept = "-" if v["acceptance_length"] is None else f"{v['acceptance_length']:.2f}"
                same = (f"default {v['default_vs_peer']:.2f}x" if "default_vs_peer" in v
                        else v["same_tokens"])
                print(f"{'':<16}{m:<16}{v['tok_s']:>8.1f}{v['tok_s_ratio']:>7.2f}"
                      f"{v['ratio_range'][0]:>6.2f}-{v['ratio_range'][1]:<4.2f}"
                      f"{v['tpot_ms']:>9.2f}{v['tpot_ratio']:>7.2f}"
                      f"{accept:>8}  {same}")


if __name__ == "__main__":
    main()
