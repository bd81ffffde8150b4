"""Multi-turn conversations with the KV tiers on and off, same workload, same script.

N conversations x M turns behind a shared system prompt; each turn sends the whole history
plus a new user message (token ids from a seeded generator, so every history is exact and
reproducible) and appends the greedy answer to the history. Turn t of every conversation
runs before turn t+1, a few requests in flight, in a seeded order per turn, so the
histories together outgrow the engines' small pools (--num-blocks): without tiers a turn
recomputes the history its engine evicted (or never had); with them it loads it from host
memory, disk or the shared Mooncake Store.

Configurations, in interleaved rounds: the default cluster (1 prefill + 1 decode) and
2 MIX engines (round robin: a conversation's turns land on either), each with every tier
on (the launcher's defaults; a fresh disk directory per run) and off. Reported per
configuration: TTFT p50/p90 per turn (streamed, to the first token), prompt tokens
computed vs not (usage.prompt_tokens_details.cached_tokens; per tier from the engines'
`xllm_kv_tier_*` metrics where they have them), output tok/s, TPOT p50, greedy tokens
that differ from the tiers-off run, and on MIX the share of turns served by another
instance than their previous turn (the service's request log) and how much of their
history those did not compute. Ratios tiers-on / tiers-off: median and spread over rounds.

--fault: one more tiers-on run in which the store's master is SIGKILLed for 10 s at the
start of a middle turn and restarted on its port: failed requests (must be 0), tokens
that differ from the tiers-off run (must be 0), and the store's hits after it returned.

    python benchmarks/bench_multiturn.py                       # gemma-3-270m, 2 rounds
    python benchmarks/bench_multiturn.py --model tiny --quick  # smoke, under 2 minutes
    python benchmarks/bench_multiturn.py --conversations 16 --turns 6 --system-len 1000
    python benchmarks/bench_multiturn.py --fault --rounds 1 --topologies mix
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import pathlib
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (completion_body, get_model_id, median,  # noqa: E402
                               percentile, report_environment)

logger = logging.getLogger(__name__)

TIERS_OFF = {"kv_host_tier_mb": 0, "kv_disk_tier_mb": 0}  # (and --kv-store off)
TOPOLOGIES = {"pd": [], "mix": ["--mix", "2", "--service-arg=--load-balance-policy=RR"]}
# the service's request log: "request <id>-<offset>-<hex>: N prompt tokens, path P on A[/B]"
_ROUTE = re.compile(r"request (\S+)-\d+-[0-9a-f]{8}: \d+ prompt tokens, path \S+ on (\S+)")
_SERIES = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")
_TIER_LABEL = re.compile(r'tier="([^"]+)"')


# ---------------------------------------------------------------------------- workload
class Conversations:
    """Token-id histories: a shared system prompt, then per turn a user message (seeded by
    (seed, conversation, turn)) and the answer the server gave."""

    def __init__(self, num: int, system_len: int, user_len: int, vocab_size: int,
                 seed: int = 0, low: int = 5) -> None:
        self.user_len, self.vocab_size, self.seed, self.low = user_len, vocab_size, seed, low
        rng = random.Random(f"{seed}:system")
        self.system = [rng.randrange(low, vocab_size) for _ in range(system_len)]
        self.histories = [list(self.system) for _ in range(num)]

    def user_message(self, conv: int, turn: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{conv}:{turn}")
        return [rng.randrange(self.low, self.vocab_size) for _ in range(self.user_len)]

    def prompt(self, conv: int, turn: int) -> list[int]:
        return self.histories[conv] + self.user_message(conv, turn)

    def answer(self, conv: int, turn: int, tokens: Sequence[int]) -> None:
        self.histories[conv] += self.user_message(conv, turn) + list(tokens)


def turn_order(num: int, turn: int, seed: int) -> list[int]:
    """The order turn `turn`'s conversations are sent in: seeded, different per turn (with
    round robin over two instances a fixed order would pin every conversation to one)."""
    order = list(range(num))
    random.Random(f"{seed}:order:{turn}").shuffle(order)
    return order


def max_prompt_len(args) -> int:
    return args.system_len + args.turns * args.user_len + (args.turns - 1) * args.answer_len


# ---------------------------------------------------------------------------- one turn
@dataclasses.dataclass
class Turn:
    conv: int
    turn: int
    ok: bool = False
    error: str | None = None
    request_id: str = ""
    instance: str = ""
    sent_s: float = 0.0  # from the run's start
    ttft_s: float | None = None
    tpot_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    history_tokens: int = 0  # the prompt less its new user message
    completion_tokens: int = 0
    token_ids: list[int] = dataclasses.field(default_factory=list)


async def stream_turn(http: httpx.AsyncClient, url: str, body: dict[str, Any], rec: Turn) -> Turn:
    """One streamed completion into `rec`: TTFT to the first chunk with tokens, TPOT over
    the rest, the answer's token ids, usage with cached_tokens, the response id."""
    t0 = time.perf_counter()
    times: list[float] = []
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    rec.error = str(event["error"])[:300]
                    return rec
                rec.request_id = event.get("id", rec.request_id)
                usage = event.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens", 0)
                    rec.completion_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens") or 0
                for choice in event.get("choices") or []:
                    if choice.get("token_ids"):
                        times.append(time.perf_counter() - t0)
                        rec.token_ids.extend(choice["token_ids"])
    except (httpx.HTTPError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
        return rec
    rec.ok = bool(rec.token_ids)
    rec.error = None if rec.ok else "no tokens"
    if times:
        rec.ttft_s = times[0]
        n = len(rec.token_ids)
        rec.tpot_s = (times[-1] - times[0]) / (n - 1) if n > 1 else None
    return rec


async def run_conversations(url: str, convs: Conversations, args,
                            before_turn: Callable[[int], Awaitable[None]] | None = None
                            ) -> tuple[list[Turn], float]:
    """Every turn of every conversation, turn by turn, `args.concurrency` in flight."""
    records: list[Turn] = []
    model = await get_model_id(url)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:
        t0 = time.perf_counter()
        for turn in range(args.turns):
            if before_turn is not None:
                await before_turn(turn)
            sem = asyncio.Semaphore(args.concurrency)

            async def one(conv: int, turn: int = turn) -> Turn:
                async with sem:
                    prompt = convs.prompt(conv, turn)
                    rec = Turn(conv, turn, history_tokens=len(prompt) - convs.user_len,
                               sent_s=time.perf_counter() - t0)
                    body = completion_body(model, prompt, args.answer_len, stream=True,
                                           return_token_ids=True)
                    await stream_turn(http, url, body, rec)
                    convs.answer(conv, turn, rec.token_ids)
                    return rec

            done = await asyncio.gather(*(one(c) for c in turn_order(len(convs.histories),
                                                                     turn, args.seed)))
            records += sorted(done, key=lambda r: r.conv)
            failed = sum(not r.ok for r in done)
            print(f"    turn {turn + 1}: {len(done)} requests, {failed} failed, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
        wall = time.perf_counter() - t0
    return records, wall


# ---------------------------------------------------------------------------- logs and metrics
def parse_routes(log_text: str) -> dict[str, str]:
    """request id -> the instance(s) the service sent it to (the last attempt wins)."""
    return {m.group(1): m.group(2) for m in _ROUTE.finditer(log_text)}


def parse_metrics(text: str, prefixes: Sequence[str]) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} for the series named with `prefixes`."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SERIES.match(line)
        if m and m.group(1).startswith(tuple(prefixes)):
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                continue
    return out


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def per_tier(deltas: dict[str, float]) -> dict[str, dict[str, float]]:
    """Series with a tier label, summed per tier and metric name (all engines)."""
    out: dict[str, dict[str, float]] = {}
    for series, value in deltas.items():
        m = _TIER_LABEL.search(series)
        if m:
            name = series.split("{", 1)[0]
            out.setdefault(m.group(1), {})
            out[m.group(1)][name] = out[m.group(1)].get(name, 0.0) + value
    return out


def landings(records: Sequence[Turn]) -> list[tuple[Turn, bool]]:
    """(turn, landed on another instance than this conversation's previous turn) for every
    turn after the first whose instance and the previous one's are known."""
    prev = {(r.conv, r.turn): r.instance for r in records}
    return [(r, r.instance != prev[(r.conv, r.turn - 1)]) for r in records
            if r.turn > 0 and r.instance and prev.get((r.conv, r.turn - 1))]


def wrong_tokens(ref: Sequence[Turn], run: Sequence[Turn]) -> list[dict[str, int]]:
    """The turns whose answer differs from the reference's: conversation, turn (from 1),
    the first position that differs and how many do."""
    by_key = {(r.conv, r.turn): r.token_ids for r in ref}
    out = []
    for r in run:
        want = by_key.get((r.conv, r.turn))
        if want is None:
            continue
        diff = [i for i, (a, b) in enumerate(zip(want, r.token_ids)) if a != b]
        n = len(diff) + abs(len(want) - len(r.token_ids))
        if n:
            out.append({"conv": r.conv, "turn": r.turn + 1, "tokens": n,
                        "first": diff[0] if diff else min(len(want), len(r.token_ids))})
    return out


# ---------------------------------------------------------------------------- summaries
def _ms(values: Sequence[float], q: float) -> float | None:
    return round(percentile(values, q) * 1000, 1) if values else None


def summarize_run(records: Sequence[Turn], wall_s: float, turns: int) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out: dict[str, Any] = {
        "requests": len(records), "failed": len(records) - len(ok),
        "first_error": next((r.error for r in records if not r.ok), None),
        "wall_s": round(wall_s, 2),
        "output_tok_s": sum(r.completion_tokens for r in ok) / wall_s if wall_s else None,
        "tpot_p50_ms": _ms([r.tpot_s for r in ok if r.tpot_s is not None], 50),
        "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
        "per_turn": []}
    for t in range(turns):
        rows = [r for r in ok if r.turn == t]
        ttft = [r.ttft_s for r in rows if r.ttft_s is not None]
        out["per_turn"].append({
            "turn": t + 1, "n": len(rows), "ttft_p50_ms": _ms(ttft, 50),
            "ttft_p90_ms": _ms(ttft, 90),
            "prompt_tokens": sum(r.prompt_tokens for r in rows),
            "cached_tokens": sum(r.cached_tokens for r in rows)})
    land = landings(ok)
    if land:
        moved = [r for r, other in land if other]
        out["cross_instance"] = {
            "turns": len(land), "moved": len(moved), "share": len(moved) / len(land),
            "history_tokens": sum(r.history_tokens for r in moved),
            "history_not_computed": sum(min(r.cached_tokens, r.history_tokens) for r in moved),
            "per_turn_fraction_min": min((min(r.cached_tokens, r.history_tokens)
                                          / r.history_tokens for r in moved), default=None)}
    return out


def spread(values: Sequence[float]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": round(median(vals), 3), "min": round(min(vals), 3),
            "max": round(max(vals), 3), "n": len(vals)}


def compare(on: Sequence[dict], off: Sequence[dict], turns: int) -> dict[str, Any]:
    """Ratios tiers-on / tiers-off, round by round (run i of each), and their spread."""
    pairs = list(zip(on, off))

    def ratio(f) -> dict | None:
        return spread([f(a) / f(b) for a, b in pairs if f(a) is not None and f(b)])

    def later_p50(s: dict) -> float | None:  # turns >= 2 pooled
        vals = [t["ttft_p50_ms"] for t in s["per_turn"][1:] if t["ttft_p50_ms"] is not None]
        return median(vals) if vals else None

    return {"ttft_p50_per_turn": [ratio(lambda s, t=t: s["per_turn"][t]["ttft_p50_ms"])
                                  for t in range(turns)],
            "ttft_p90_per_turn": [ratio(lambda s, t=t: s["per_turn"][t]["ttft_p90_ms"])
                                  for t in range(turns)],
            "ttft_p50_turns_2_on": ratio(later_p50),
            "tpot_p50": ratio(lambda s: s["tpot_p50_ms"]),
            "output_tok_s": ratio(lambda s: s["output_tok_s"])}


# ---------------------------------------------------------------------------- a cluster run
def engine_urls(cluster) -> list[str]:
    return [p.http_url for p in cluster.children if p is not cluster.service]


def scrape(urls: Sequence[str]) -> dict[str, float]:
    total: dict[str, float] = {}
    for i, url in enumerate(urls):
        try:
            text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
        except httpx.HTTPError:
            continue
        for k, v in parse_metrics(text, ("xllm_kv_tier", "xllm_prefix_cache")).items():
            total[f"{k}@{i}"] = v
    return total


def run_config(name: str, topology: str, tiers: bool, args, root: pathlib.Path,
               fault: bool = False) -> tuple[dict[str, Any], list[Turn]]:
    from xllm_py.launch import Cluster, build_parser
    from xllm_py.utils.config_file import write_settings
    from xllm_py.utils.procs import free_port

    log_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    argv = ["--model", args.model, "--http-port", str(free_port()), "--log-dir", str(log_dir),
            f"--engine-arg=--num-blocks={args.num_blocks}", "--log-level", "WARNING",
            *TOPOLOGIES[topology]]
    settings = {"kv_disk_tier_dir": str(log_dir / "kv-disk")} if tiers else TIERS_OFF
    argv += [f"--engine-arg=--config={log_dir / 'engine.yaml'}",
             *([] if tiers else ["--kv-store", "off"])]
    write_settings(log_dir / "engine.yaml", settings)
    print(f"  {name}: {' '.join(argv)}", flush=True)
    cluster = Cluster(build_parser().parse_args(argv))
    fault_info: dict[str, Any] = {}
    try:
        cluster.start()
        urls = engine_urls(cluster)
        before = scrape(urls)
        hook = None
        if fault:
            if cluster.store is None:
                raise RuntimeError("--fault needs the embedded Mooncake Store (see the launcher's log)")
            hook = fault_hook(cluster, urls, args, fault_info)
        records, wall = asyncio.run(run_conversations(
            cluster.url, Conversations(**workload_kwargs(args)), args, hook))
        after = scrape(urls)
        routes = parse_routes((log_dir / "service.log").read_text(errors="replace"))
    finally:
        cluster.stop()
        shutil.rmtree(log_dir / "kv-disk", ignore_errors=True)
    for r in records:
        r.instance = routes.get(r.request_id, "")
    summary = summarize_run(records, wall, args.turns)
    summary.update(config=name, topology=topology, tiers=tiers, log_dir=str(log_dir),
                   tiers_metrics=per_tier(metric_deltas(before, after)),
                   metrics_delta=metric_deltas(before, after))
    if fault:
        summary["fault"] = fault_result(fault_info, records, after)
    return summary, records


def fault_hook(cluster, urls: list[str], args, info: dict[str, Any]):
    """At the start of the fault turn: SIGKILL the store's master, bring it back on its
    port --fault-down-s later (a task beside the turn's requests)."""
    fault_turn = max(1, (args.turns - 1) // 2)

    async def outage(t0: float) -> None:
        await asyncio.sleep(0.5)  # (the turn's first requests are in flight)
        cluster.store.kill_master()
        info["killed_s"] = time.perf_counter() - t0
        await asyncio.sleep(args.fault_down_s)
        await asyncio.to_thread(cluster.store.start_master)
        info["restarted_s"] = time.perf_counter() - t0
        info["metrics_at_restart"] = await asyncio.to_thread(scrape, urls)

    async def hook(turn: int) -> None:
        if turn == 0:
            info["t0"] = time.perf_counter()
        if turn == fault_turn:
            info["turn"] = turn + 1
            info["task"] = asyncio.create_task(outage(info["t0"]))
        if turn == args.turns - 1 and "task" in info and turn != fault_turn:
            await info["task"]  # (the master is back before the last turn)

    return hook


def fault_result(info: dict[str, Any], records: Sequence[Turn],
                 after: dict[str, float]) -> dict[str, Any]:
    killed, back = info.get("killed_s"), info.get("restarted_s")
    out: dict[str, Any] = {"killed_at_s": killed, "restarted_at_s": back,
                           "fault_turn": info.get("turn"),
                           "failed": sum(not r.ok for r in records)}
    if back is not None:
        out["tiers_after_restart"] = per_tier(metric_deltas(info["metrics_at_restart"], after))
        later = [r for r, other in landings([r for r in records if r.ok])
                 if other and r.sent_s >= back]
        out["moved_turns_after_restart"] = len(later)
        out["moved_history_not_computed_after_restart"] = (
            sum(min(r.cached_tokens, r.history_tokens) for r in later)
            / max(1, sum(r.history_tokens for r in later)))
    return out


def workload_kwargs(args) -> dict[str, Any]:
    return {"num": args.conversations, "system_len": args.system_len,
            "user_len": args.user_len, "vocab_size": args.vocab_size, "seed": args.seed}


def auto_num_blocks(args) -> int:
    """A pool that just holds `concurrency` of the longest conversations being computed (a
    2,048-token chunk at a time: a sliding-window group holds the chunk and the window
    before it), so what the other conversations' turns compute evicts a history."""
    from xllm_py.model.catalog import resolve_model
    from xllm_py.model.kv_groups import kv_groups

    config = json.loads((pathlib.Path(resolve_model(args.model)) / "config.json").read_text())
    config = config.get("text_config", config)
    n_layers, window = config["num_hidden_layers"], config.get("sliding_window") or 0
    types = config.get("layer_types") or ["full_attention"] * n_layers
    groups = kv_groups([window if t == "sliding_attention" else 0 for t in types])
    length, bs = max_prompt_len(args) + args.answer_len, args.block_size
    chunk = min(length, 2048)
    peak = sum(-(-length // bs) if not w else -(-(chunk + w) // bs) + 1
               for w in groups.group_windows)
    return args.concurrency * (peak + 2)


# ---------------------------------------------------------------------------- report
def pooled(runs: Sequence[tuple[dict, list[Turn]]], turns: int) -> dict[str, Any]:
    """Every run's turns in one summary; landings counted run by run (instance names are
    a run's own)."""
    records = [r for _, recs in runs for r in recs]
    out = summarize_run(records, sum(s["wall_s"] for s, _ in runs), turns)
    out.pop("cross_instance", None)
    per_run = [s["cross_instance"] for s, _ in runs if "cross_instance" in s]
    if per_run:
        out["cross_instance"] = {k: sum(x[k] for x in per_run) for k in
                                 ("turns", "moved", "history_tokens", "history_not_computed")}
        out["cross_instance"]["share"] = (out["cross_instance"]["moved"]
                                          / max(1, out["cross_instance"]["turns"]))
        mins = [x["per_turn_fraction_min"] for x in per_run if x["per_turn_fraction_min"] is not None]
        out["cross_instance"]["per_turn_fraction_min"] = min(mins, default=None)
    return out


def _fmt(x, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def _ratio(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{s['median']:.2f}x [{s['min']:.2f}..{s['max']:.2f}]"


def print_report(result: dict[str, Any], turns: int) -> None:
    print(f"\n{'config':<9} {'turn':>4} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} "
          f"{'prompt tok':>11} {'not computed':>13}")
    for name, c in result["configs"].items():
        for t in c["pooled"]["per_turn"]:
            print(f"{name:<9} {t['turn']:>4} {_fmt(t['ttft_p50_ms']):>12} "
                  f"{_fmt(t['ttft_p90_ms']):>12} {t['prompt_tokens']:>11} {t['cached_tokens']:>13}")
    print(f"\n{'config':<9} {'computed':>9} {'loaded/hit':>11} {'out tok/s':>10} "
          f"{'TPOT p50 ms':>12} {'failed':>7} {'wrong tok':>10}  moved to another instance")
    for name, c in result["configs"].items():
        p = c["pooled"]
        x = p.get("cross_instance")
        moved = (f"{x['moved']}/{x['turns']} turns, history not computed "
                 f"{x['history_not_computed'] / max(1, x['history_tokens']):.0%} (min "
                 f"{_fmt(x['per_turn_fraction_min'], '.0%')})" if x and x["moved"] else "-")
        print(f"{name:<9} {p['computed_tokens']:>9} {p['cached_tokens']:>11} "
              f"{_fmt(p['output_tok_s'], '.1f'):>10} {_fmt(p['tpot_p50_ms'], '.1f'):>12} "
              f"{p['failed']:>7} {sum(s['wrong_tokens'] for s in c['runs']):>10}  {moved}")
        for m in [m for s in c["runs"] for m in s["mismatches"]][:5]:
            print(f"{'':<9}   differs from tiers off: conversation {m['conv']} turn {m['turn']}, "
                  f"{m['tokens']} tokens from token {m['first']}")
        for tier, values in sorted(c["tiers_metrics"].items()):
            shown = ", ".join(f"{k.removeprefix('xllm_kv_tier_')} {v:g}"
                              for k, v in sorted(values.items()))
            print(f"{'':<9}   tier {tier}: {shown}")
    for topo, r in result["ratios"].items():
        print(f"\n{topo}: tiers on / off (median [min..max] over {r['tpot_p50'] and r['tpot_p50']['n']} "
              f"rounds)")
        for t, (a, b) in enumerate(zip(r["ttft_p50_per_turn"], r["ttft_p90_per_turn"])):
            print(f"  turn {t + 1}: TTFT p50 {_ratio(a)}, p90 {_ratio(b)}")
        print(f"  turns >= 2, TTFT p50: {_ratio(r['ttft_p50_turns_2_on'])}; TPOT p50 "
              f"{_ratio(r['tpot_p50'])}; output tok/s {_ratio(r['output_tok_s'])}")
    f = result.get("fault")
    if f:
        print(f"\nfault ({f['config']}): master SIGKILLed at {_fmt(f['killed_at_s'], '.1f')} s "
              f"(turn {f['fault_turn']}), back at {_fmt(f['restarted_at_s'], '.1f')} s; failed "
              f"{f['failed']}, wrong tokens {f['wrong_tokens']} in {f['wrong_turns']} turns vs "
              f"tiers off; moved turns after the restart: {f.get('moved_turns_after_restart')}, "
              f"their history not computed "
              f"{_fmt(f.get('moved_history_not_computed_after_restart'), '.0%')}")
        for tier, values in sorted((f.get("tiers_after_restart") or {}).items()):
            shown = ", ".join(f"{k.removeprefix('xllm_kv_tier_')} {v:g}"
                              for k, v in sorted(values.items()))
            print(f"  after the restart, tier {tier}: {shown}")


def mark_wrong(summary: dict[str, Any], ref: Sequence[Turn], records: Sequence[Turn]) -> None:
    """The run's answers against the tiers-off reference, and its turns, into `summary`."""
    summary["mismatches"] = wrong_tokens(ref, records)
    summary["wrong_turns"] = len(summary["mismatches"])
    summary["wrong_tokens"] = sum(m["tokens"] for m in summary["mismatches"])
    summary["turns"] = [dataclasses.asdict(r) for r in records]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m", help="the launcher's --model")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=400, help="shared system prompt tokens")
    p.add_argument("--user-len", type=int, default=256, help="new user tokens per turn")
    p.add_argument("--answer-len", type=int, default=32, help="greedy tokens per answer")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--topologies", default="pd,mix", help="comma list of pd, mix")
    p.add_argument("--num-blocks", type=int, default=0,
                   help="each engine's pool (0: what `concurrency` longest prompts need)")
    p.add_argument("--block-size", type=int, default=16, help="the engines' (default) block size")
    p.add_argument("--fault", action="store_true",
                   help="one more tiers-on run with the store's master SIGKILLed mid-run")
    p.add_argument("--fault-topology", default="mix", choices=sorted(TOPOLOGIES))
    p.add_argument("--fault-down-s", type=float, default=10.0)
    p.add_argument("--quick", action="store_true",
                   help="a smoke: 4 conversations x 3 turns, short prompts, 1 round")
    p.add_argument("--vocab-size", type=int, default=1000, help="prompt token ids below this")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--output", default=None, help="JSON results (default: in the run's folder)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.conversations, args.turns, args.system_len = 4, 3, 256
        args.user_len, args.answer_len, args.rounds = 128, 16, 1
    topologies = [t for t in args.topologies.split(",") if t]
    if not topologies or any(t not in TOPOLOGIES for t in topologies):
        p.error(f"--topologies: a comma list of {', '.join(TOPOLOGIES)}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args.num_blocks = args.num_blocks or auto_num_blocks(args)
    result: dict[str, Any] = {"args": vars(args)}
    report_environment(result)
    root = pathlib.Path(tempfile.mkdtemp(prefix="xllm-bench-multiturn-"))
    histories = args.conversations * (max_prompt_len(args) - args.system_len) + args.system_len
    print(f"{args.conversations} conversations x {args.turns} turns on {args.model}: system "
          f"prompt {args.system_len}, +{args.user_len} user and {args.answer_len} answer tokens "
          f"a turn (the last prompt {max_prompt_len(args)} tokens, {histories} tokens of "
          f"history in all), {args.concurrency} in flight, {args.num_blocks} blocks of "
          f"{args.block_size} per engine; logs in {root}", flush=True)
    runs: dict[str, list[tuple[dict, list[Turn]]]] = {}
    for rnd in range(args.rounds):
        for topo in topologies:
            for tiers in ((True, False) if rnd % 2 == 0 else (False, True)):
                name = f"{topo}-{'on' if tiers else 'off'}"
                runs.setdefault(name, []).append(run_config(name, topo, tiers, args, root))
    fault = None
    if args.fault:
        topo = args.fault_topology
        if f"{topo}-off" not in runs:
            runs[f"{topo}-off"] = [run_config(f"{topo}-off", topo, False, args, root)]
        fault = run_config(f"{topo}-fault", topo, True, args, root, fault=True)
    result["configs"] = {}
    for name, rs in runs.items():
        ref = runs.get(name.split("-")[0] + "-off", [(None, None)])[0][1] or rs[0][1]
        for s, recs in rs:
            mark_wrong(s, ref, recs)
        tiers: dict[str, dict[str, float]] = {}
        for s, _ in rs:
            for tier, values in s["tiers_metrics"].items():
                for k, v in values.items():
                    tiers.setdefault(tier, {})[k] = tiers.get(tier, {}).get(k, 0.0) + v
        result["configs"][name] = {"runs": [s for s, _ in rs], "pooled": pooled(rs, args.turns),
                                   "tiers_metrics": tiers}
    result["ratios"] = {topo: compare([s for s, _ in runs[f"{topo}-on"]],
                                      [s for s, _ in runs[f"{topo}-off"]], args.turns)
                        for topo in topologies if f"{topo}-on" in runs}
    if fault is not None:
        s, recs = fault
        mark_wrong(s, runs[f"{args.fault_topology}-off"][0][1], recs)
        result["fault"] = {**s["fault"], "config": s["config"], "wrong_turns": s["wrong_turns"],
                           "wrong_tokens": s["wrong_tokens"], "run": s}
    print_report(result, args.turns)
    out = pathlib.Path(args.output or root / "bench_multiturn.json")
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
