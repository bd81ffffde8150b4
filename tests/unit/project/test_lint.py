"""pyflakes-level checks (undefined names, unused imports, names used after their scope)
over the whole tree: cheap, and they catch bugs that only fire on error paths."""
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.integration  # (runs ruff in a subprocess)
def test_ruff_pyflakes_clean():
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).parent / "ruff")
    if not pathlib.Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e .[test])")
    result = subprocess.run([ruff, "check", "--no-cache", "xllm_py", "xllm_service", "tests",
                             "benchmarks", "scripts"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
