"""The README stays a guide: short, the test command CI runs, every benchmark
on one line there with its figures and history in docs/benchmarks.md."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()
BENCH_DOC = (ROOT / "docs" / "benchmarks.md").read_text()
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))


def test_readme_is_short_and_keeps_the_ci_test_command():
    assert len(README.splitlines()) <= 260
    assert "\n./scripts/test.sh\n" in README  # .ci/run runs exactly this
    assert "(docker/README.md)" in README and "(deploy/k8s/README.md)" in README
    assert "Python >= 3.11" in README


def test_every_benchmark_is_one_readme_line_and_a_row_in_the_history():
    section = README.split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("- `python benchmarks/")]
    named = {re.match(r"- `python benchmarks/(bench_\w+\.py)", ln).group(1) for ln in lines}
    assert named == set(SCRIPTS), (
        "each benchmarks/bench_*.py needs one line in the README's Benchmarks section "
        f"(command and figure) and a row in docs/benchmarks.md: {set(SCRIPTS) ^ named}")
    assert all(len(ln) <= 160 for ln in lines), max(lines, key=len)
    for script in SCRIPTS:
        assert f"benchmarks/{script}" in BENCH_DOC, script
