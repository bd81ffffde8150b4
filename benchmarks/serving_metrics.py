"""Metrics of benchmarks/bench_serving.py: percentiles, the per-run summary (throughput,
goodput under SLOs, TTFT/TPOT/ITL/E2E), the side-by-side table and latency CDF plots."""
from __future__ import annotations

import math
import pathlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.bench_serving import RequestResult

PERCENTILES = (50, 90, 99)

def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; nan if empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _dist_ms(xs: list[float]) -> dict[str, float]:
    ms = [x * 1000.0 for x in xs]
    d = {"mean": sum(ms) / len(ms) if ms else float("nan")}
    for q in PERCENTILES:
        d[f"p{q}"] = percentile(ms, q)
    return d


def _meets(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if slo_ttft_ms is not None and r.ttft * 1000 > slo_ttft_ms:
        return False
    tp = r.tpot
    return slo_tpot_ms is None or tp is None or tp * 1000 <= slo_tpot_ms


def summarize(results: list[RequestResult], duration: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None,
              tpot_grid_ms: tuple[float, ...] = ()) -> dict[str, Any]:
    """`tpot_grid_ms`: goodput also at each of these TPOT targets (TTFT target as given),
    from the same requests: how the comparison moves with the target (DistServe's SLO
    scale)."""
    ok = [r for r in results if r.ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    itls = [x for r in ok for x in r.itl]
    n_in = sum(r.input_len for r in ok)
    n_out = sum(r.output_len for r in ok)

    def num_good(tpot_ms: float | None) -> int:
        return sum(1 for r in ok if _meets(r, slo_ttft_ms, tpot_ms))

    good = num_good(slo_tpot_ms)
    errors = [r.error for r in results if not r.ok]
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted(set(errors))[:5],
        "duration_s": duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": n_out / duration if duration else 0.0,
        "total_token_throughput": (n_in + n_out) / duration if duration else 0.0,
        "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
        "goodput": good / duration if duration else 0.0,
        "slo_attainment": good / len(results) if results else 0.0,
        "goodput_by_tpot_slo": {f"{t:g}": num_good(t) / duration if duration else 0.0
                                for t in tpot_grid_ms},
        "ttft_ms": _dist_ms([r.ttft for r in ok]),
        "tpot_ms": _dist_ms(tpots),
        "itl_ms": _dist_ms(itls),
        "e2e_ms": _dist_ms([r.e2e for r in ok]),
    }


_ROWS: list[tuple[str, str, str]] = [  # (label, key path, format)
    ("completed / failed", "completed/failed", "{}"),
    ("duration (s)", "duration_s", "{:.1f}"),
    ("request throughput (req/s)", "request_throughput", "{:.3f}"),
    ("output throughput (tok/s)", "output_throughput", "{:.1f}"),
    ("total token throughput (tok/s)", "total_token_throughput", "{:.1f}"),
    ("goodput (req/s)", "goodput", "{:.3f}"),
    ("SLO attainment", "slo_attainment", "{:.1%}"),
] + [(f"{m.upper()} {s} (ms)", f"{m}_ms.{s}", "{:.1f}")
     for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "p50", "p90", "p99")]


def _cell(summary: dict[str, Any], key: str, fmt: str) -> str:
    if key == "completed/failed":
        return f"{summary['completed']} / {summary['failed']}"
    v: Any = summary
    for part in key.split(".", 1):  # (a grid key may hold a dot: "25.5")
        v = v[part]
    return fmt.format(v)


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    """Rows = metrics, one column per run (a goodput row per TPOT target of the grid)."""
    names = list(summaries)
    grid = list(next(iter(summaries.values()), {}).get("goodput_by_tpot_slo", {}))
    rows = _ROWS[:6] + [(f"  goodput, TPOT <= {t} ms (req/s)", f"goodput_by_tpot_slo.{t}",
                         "{:.3f}") for t in grid] + _ROWS[6:]
    width = max(len(r[0]) for r in rows) + 2
    cols = [max(12, len(n) + 2) for n in names]
    lines = ["".ljust(width) + "".join(n.rjust(c) for n, c in zip(names, cols))]
    lines.append("-" * (width + sum(cols)))
    for label, key, fmt in rows:
        lines.append(label.ljust(width) + "".join(
            _cell(summaries[n], key, fmt).rjust(c) for n, c in zip(names, cols)))
    return "\n".join(lines)


def plot_cdfs(runs: dict[str, list[RequestResult]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, results in runs.items():
        ok = [r for r in results if r.ok]
        series = {
            "TTFT (ms)": [r.ttft * 1000 for r in ok],
            "TPOT (ms)": [r.tpot * 1000 for r in ok if r.tpot is not None],
            "ITL (ms)": [x * 1000 for r in ok for x in r.itl],
        }
        for ax, (title, xs) in zip(axes, series.items()):
            xs = sorted(xs)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
            ax.set_xlabel(title)
            ax.set_ylabel("fraction of requests" if title != "ITL (ms)" else "fraction of gaps")
            ax.grid(True, alpha=0.3)
    axes[2].set_xscale("log")
    for ax in axes:
        ax.legend(loc="lower right")
    fig.suptitle("latency CDFs")
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
