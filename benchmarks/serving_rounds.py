"""Repeated --compare rounds of benchmarks/bench_serving.py: one set-up's goodput against
the best of the others, and its TPOT p99 against a reference set-up, round by round.

A single --compare round on a shared 2-core machine is one draw: the same seeded
workload gave MIX 1.27-1.90 req/s at one TPOT target over eight runs (issue 16). What a
comparison claims needs the spread, from the same command: `--repeat N` runs the
set-ups N times (each round in a rotated order, so a drift of the machine's load does
not always fall on the same set-up) and this module reduces the rounds to

    ratio[target][round] = goodput(subject) / max(goodput(other set-ups))
    tpot_p99_diff[round] = TPOT p99(subject) - TPOT p99(reference)   (ms)

for the run's TPOT target and each target of --slo-tpot-grid (the TTFT target as given).
Without --slo-ttft-ms / --slo-tpot-ms a round is counted at the SLO its default set-up's
service stated (`stated_slo`, `at_stated_slo`).
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

import httpx

from benchmarks.serving_metrics import summarize


def rotated(setups: list[str], round_index: int) -> list[str]:
    """The set-ups' order in round `round_index` (0-based): rotated by the round."""
    k = round_index % len(setups) if setups else 0
    return setups[k:] + setups[:k]


def _goodput_at(summary: dict[str, Any], target: str | None) -> float:
    return summary["goodput"] if target is None else summary["goodput_by_tpot_slo"][target]


def verdict(rounds: list[dict[str, dict[str, Any]]], subject: str,
            reference: str | None = None) -> dict[str, Any]:
    """`rounds`: per round, set-up label -> summary (serving_metrics.summarize). The
    subject's goodput ratio to the best other set-up at each TPOT target ("run": the
    run's own target), and its TPOT p99 minus the reference's (None without one)."""
    if not rounds or any(subject not in r for r in rounds):
        raise ValueError(f"every round needs the subject set-up {subject!r}")
    if any(len(r) < 2 for r in rounds):
        raise ValueError("a ratio needs at least one set-up besides the subject")
    first = rounds[0][subject]
    targets: list[str | None] = [None, *first.get("goodput_by_tpot_slo", {})]
    ratios: dict[str, list[float | None]] = {}
    for target in targets:
        row: list[float | None] = []
        for r in rounds:
            best_other = max(_goodput_at(s, target) for name, s in r.items() if name != subject)
            mine = _goodput_at(r[subject], target)
            row.append(mine / best_other if best_other > 0 else None)
        ratios["run" if target is None else target] = row
    diffs = None
    if reference is not None:
        diffs = [r[subject]["tpot_ms"]["p99"] - r[reference]["tpot_ms"]["p99"] for r in rounds]
    return {"subject": subject, "reference": reference, "rounds": len(rounds),
            "slo_tpot_ms": first.get("slo_tpot_ms"), "goodput_ratio": ratios,
            "tpot_p99_diff_ms": diffs}


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def format_verdict(v: dict[str, Any], at_least: float = 1.2) -> str:
    """One line per TPOT target: the ratio in each round, min / median / max, and in how
    many rounds it reached `at_least`; then the TPOT p99 differences."""
    lines = [f"{v['subject']} over the best other set-up, {v['rounds']} round(s): goodput "
             f"ratio per round, min / median / max, rounds >= {at_least:g}x"]
    for target, row in v["goodput_ratio"].items():
        label = (f"TPOT <= {v['slo_tpot_ms']:g} ms (the run's)" if target == "run"
                 and v["slo_tpot_ms"] is not None else
                 "no TPOT target" if target == "run" else f"TPOT <= {target} ms")
        xs = [x for x in row if x is not None]
        cells = " ".join("-" if x is None else f"{x:.2f}" for x in row)
        tail = (f"{_spread(xs)}, {sum(x >= at_least for x in xs)} of {len(row)}"
                if xs else "no goodput in any other set-up")
        lines.append(f"  {label:<28} {cells}   {tail}")
    if v["tpot_p99_diff_ms"] is not None:
        d = v["tpot_p99_diff_ms"]
        lines.append(f"  TPOT p99 minus {v['reference']}'s (ms): "
                     + " ".join(f"{x:+.1f}" for x in d)
                     + f"   median {statistics.median(d):+.1f}, no worse in "
                     f"{sum(x <= 0 for x in d)} of {len(d)}")
    return "\n".join(lines)


def stated_slo(url: str) -> tuple[float, float] | None:
    """The (TTFT, TPOT) targets a service states (xllm_service_slo_target_ms on its
    /metrics: the operator's, else derived from the latency profiles); None: none."""
    text = httpx.get(url + "/metrics", timeout=10.0, trust_env=False).text
    found = {}
    for line in text.splitlines():
        if line.startswith("xllm_service_slo_target_ms{"):
            name = line.split('target="', 1)[1].split('"', 1)[0]
            found[name] = float(line.rsplit(" ", 1)[1])
    return (found["ttft"], found["tpot"]) if {"ttft", "tpot"} <= set(found) else None


def at_stated_slo(args: argparse.Namespace, summaries: dict[str, Any],
                  runs: dict[str, list],
                  stated: tuple[float, float] | None) -> dict[str, Any]:
    """A round's summaries at the SLO its default set-up stated, where --slo-ttft-ms and
    --slo-tpot-ms are not given (else as they are)."""
    if stated is None or args.slo_ttft_ms is not None or args.slo_tpot_ms is not None:
        return summaries
    return {label: summarize(runs[label], s["duration_s"], stated[0], stated[1],
                             tuple(args.slo_tpot_grid)) for label, s in summaries.items()}
