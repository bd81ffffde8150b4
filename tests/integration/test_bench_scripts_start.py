"""Every benchmark starts as the README runs it, `python benchmarks/<name>.py`, from a
clone: not only from the repository root with the root on the import path (three of
them did not, and their README commands failed on a fresh clone)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_starts_from_any_directory(script: str, tmp_path: pathlib.Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
