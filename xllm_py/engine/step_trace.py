"""StepTrace: one JSON line per engine step (the setting `step_trace: FILE`), for finding where a
latency tail comes from.

A TPOT or ITL percentile says that streams were slow, not which steps made them so. Each
line is what one step carried and what it cost:

    {"t": 1234.5678, "ms": 54.1, "decode_seqs": 6, "decode_context": 7410,
     "prompt_seqs": 1, "prompt_tokens": 64, "waiting": 2,
     "guard": "slack", "guard_step_ms": 11.2, "guard_token_ms": 0.61}

t: when the step's forward began, schedule() done (time.monotonic, seconds); ms: its
forward, sampling and scheduler update (what the TPOT guard measures); decode_context: the tokens the decoding streams
attend to; guard: the TPOT guard's answer this step (tpot_guard.py: "slack", "held",
"too small", "hold limit", "unmeasured"; "" when it was not asked, null without a guard)
and the cost estimates it sized the step with (a decode-only step, a prompt token beside
streams). `python -m xllm_py.engine.step_trace FILE` reduces a trace (`summarize`).

Pure Python, no torch: a step observer of the engine (step_observers.py), handed each
step's record (the scheduler's output among it). Written line by line
(flushed each step), so a trace survives a killed engine; off unless asked for.
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
from typing import IO, TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from xllm_py.engine.scheduler_types import SchedulerOutput
    from xllm_py.engine.step_observers import StepRecord
    from xllm_py.engine.tpot_guard import TpotGuard

logger = logging.getLogger(__name__)


class StepTrace:
    def __init__(self, path: str) -> None:
        # "{pid}" in the path: one file per engine process (engines launched with one
        # shared flag, e.g. the launcher's --engine-arg, would interleave in one file)
        self.path = path.replace("{pid}", str(os.getpid()))
        self._f: IO[str] | None = open(self.path, "a", encoding="utf-8", buffering=1)

    def on_step(self, step: StepRecord) -> None:
        self.record(step.start_s, step.ms, step.out, step.num_waiting, step.guard)

    def record(self, start_s: float, duration_ms: float, out: SchedulerOutput,
               num_waiting: int, guard: TpotGuard | None) -> None:
        if self._f is None:
            return
        decodes = out.seqs[:out.num_decode_seqs]
        prompts = out.seqs[out.num_decode_seqs:]
        line = {
            "t": round(start_s, 4), "ms": round(duration_ms, 2),
            "decode_seqs": len(decodes),
            "decode_context": sum(s.start_pos for s in decodes),
            "prompt_seqs": len(prompts),
            "prompt_tokens": sum(len(s.token_ids) for s in prompts),
            "waiting": num_waiting,
            "guard": None if guard is None else guard.last_decision,
        }
        if guard is not None:  # its estimates when it sized this step (before the step)
            step_s, token_s = guard.step_estimates
            line["guard_step_ms"] = None if step_s is None else round(step_s * 1e3, 2)
            line["guard_token_ms"] = None if token_s is None else round(token_s * 1e3, 3)
        try:
            self._f.write(json.dumps(line) + "\n")
        except (OSError, ValueError) as e:  # a full disk (or a closed file) ends the trace
            logger.warning("step trace %s stopped: %s", self.path, e)
            self.close()

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None


# -- reading a trace -------------------------------------------------------------------

def summarize(steps: Iterable[dict[str, Any]], slow_ms: float = 30.0) -> dict[str, Any]:
    """What a trace says: busy time; decode-only steps by batch size (their cost);
    steps that carried prompt tokens beside streams, by the guard's answer, with the
    stall they put on the streams (a step's ms over a decode-only step of its batch size,
    times its streams); and how many steps with streams ran over `slow_ms`, and why."""
    steps = list(steps)
    if not steps:
        return {"steps": 0}
    by_batch: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for s in steps:
        if s["decode_seqs"] and not s["prompt_tokens"]:
            by_batch[s["decode_seqs"]].append(s)
    # The loop's time between two decode-only steps of a batch (the next step's start less
    # this one's end): output processing, detokenizing, command draining, schedule(); what
    # a stream's TPOT carries beside the steps. Gaps of a second or more are idle waits.
    between: dict[int, list[float]] = collections.defaultdict(list)
    for a, b in zip(steps, steps[1:]):
        if (a["decode_seqs"] == b["decode_seqs"] and a["decode_seqs"]
                and not a["prompt_tokens"] and not b["prompt_tokens"]):
            gap_ms = (b["t"] - a["t"]) * 1000 - a["ms"]
            if 0 <= gap_ms < _IDLE_GAP_MS:
                between[a["decode_seqs"]].append(gap_ms)
    decode_only = {b: {"steps": len(xs), **_ms_p50_p90(xs),
                       "context_p50": _pct([x["decode_context"] for x in xs], 50),
                       "between_ms_p50": _pct(between[b], 50) if between[b] else None}
                   for b, xs in sorted(by_batch.items())}
    riding = collections.defaultdict(lambda: {"steps": 0, "prompt_tokens": 0, "stall_stream_ms": 0.0})
    slow = collections.Counter()
    for s in steps:
        if not s["decode_seqs"]:
            continue
        why = "decode only" if not s["prompt_tokens"] else f"prompt ({s['guard'] or 'no guard'})"
        if s["ms"] > slow_ms:
            slow[why] += 1
        if s["prompt_tokens"]:
            base = decode_only.get(s["decode_seqs"], {}).get("ms_p50", 0.0)
            r = riding[s["guard"] or "no guard"]
            r["steps"] += 1
            r["prompt_tokens"] += s["prompt_tokens"]
            r["stall_stream_ms"] += max(0.0, s["ms"] - base) * s["decode_seqs"]
    # the guard's estimates against what the steps took: a decode-only step, and the
    # stall of a prompt chunk beside streams (ms over the decode-only estimate, per token)
    step_err = [s["ms"] / s["guard_step_ms"] for s in steps if s["decode_seqs"]
                and not s["prompt_tokens"] and s.get("guard_step_ms")]
    token_err = [(s["ms"] - s["guard_step_ms"]) / (s["guard_token_ms"] * s["prompt_tokens"])
                 for s in steps if s["decode_seqs"] and s["prompt_tokens"]
                 and s.get("guard_step_ms") and s.get("guard_token_ms")]
    guard_accuracy = {name: {f"p{q}": _pct(xs, q) for q in (10, 50, 90)}
                      for name, xs in (("step", step_err), ("prompt_stall", token_err)) if xs}
    alone = [s for s in steps if s["prompt_tokens"] and not s["decode_seqs"]]
    prompt_only = ({"steps": len(alone), "prompt_tokens": sum(s["prompt_tokens"] for s in alone),
                    "tokens_p50": _pct([s["prompt_tokens"] for s in alone], 50),
                    **_ms_p50_p90(alone)} if alone else None)
    span = steps[-1]["t"] + steps[-1]["ms"] / 1000 - steps[0]["t"]
    return {"steps": len(steps), "span_s": span, "busy_s": sum(s["ms"] for s in steps) / 1000,
            "with_streams": sum(1 for s in steps if s["decode_seqs"]),
            "prompt_only": prompt_only, "guard_measured_over_estimate": guard_accuracy,
            "decode_only_by_batch": decode_only, "prompts_beside_streams": dict(riding),
            "slow_ms": slow_ms, "slow_steps_with_streams": dict(slow)}


_IDLE_GAP_MS = 1000.0


def _ms_p50_p90(steps: list[dict[str, Any]]) -> dict[str, float]:
    ms = [s["ms"] for s in steps]
    return {"ms_p50": _pct(ms, 50), "ms_p90": _pct(ms, 90)}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round((len(s) - 1) * q / 100)))]


def format_summary(sm: dict[str, Any]) -> str:
    if not sm["steps"]:
        return "no steps"
    lines = [f"{sm['steps']} steps ({sm['with_streams']} with decoding streams), busy "
             f"{sm['busy_s']:.1f} s of {sm['span_s']:.1f} s"]
    if sm["decode_only_by_batch"]:
        lines.append("decode-only steps: batch  steps  ms p50  ms p90  context p50"
                     "  between p50 (ms)")
    for b, d in sm["decode_only_by_batch"].items():
        gap = "-" if d.get("between_ms_p50") is None else f"{d['between_ms_p50']:.2f}"
        lines.append(f"  {b:>21}  {d['steps']:>5}  {d['ms_p50']:>6.1f}  {d['ms_p90']:>6.1f}"
                     f"  {d['context_p50']:>11}  {gap:>16}")
    if sm["prompts_beside_streams"]:
        lines.append("prompt tokens beside streams, by the guard's answer: steps, tokens, "
                     "stall (stream-ms over a decode-only step of the batch)")
    for why, r in sorted(sm["prompts_beside_streams"].items()):
        lines.append(f"  {why:<12} {r['steps']:>6} {r['prompt_tokens']:>8} "
                     f"{r['stall_stream_ms']:>10.0f}")
    if sm["prompt_only"]:
        po = sm["prompt_only"]
        lines.append(f"prompt-only steps (no streams): {po['steps']}, {po['prompt_tokens']} "
                     f"tokens, {po['tokens_p50']} a step (p50), ms p50 {po['ms_p50']:.1f} "
                     f"p90 {po['ms_p90']:.1f}")
    for name, d in sm["guard_measured_over_estimate"].items():
        lines.append(f"guard's {name.replace('_', ' ')} estimate, measured / estimated: "
                     f"p10 {d['p10']:.2f} p50 {d['p50']:.2f} p90 {d['p90']:.2f}")
    lines.append(f"steps with streams over {sm['slow_ms']:g} ms: "
                 + (", ".join(f"{k} {v}" for k, v in sorted(sm["slow_steps_with_streams"].items()))
                    or "none"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xllm_py.engine.step_trace",
                                description="Summarize an engine's step trace file.")
    p.add_argument("trace", nargs="+", help="trace files (one JSON object per line)")
    p.add_argument("--slow-ms", type=float, default=30.0,
                   help="count the steps with streams over this long, and what they carried")
    args = p.parse_args(argv)
    for path in args.trace:
        with open(path, encoding="utf-8") as f:
            steps = [json.loads(line) for line in f if line.strip()]
        print(f"{path}:\n{format_summary(summarize(steps, args.slow_ms))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
