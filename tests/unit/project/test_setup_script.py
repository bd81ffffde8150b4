"""scripts/setup.sh picks torch's build: the CPU build from the PyTorch CPU index when the
venv has no torch, pip's own configuration when that index cannot be reached, the CUDA
build with --gpu, and an existing torch left alone. Its --dry-run runs nothing; the other
cases run it against a stand-in venv whose python records the pip commands instead of
installing anything."""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "setup.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# A venv's bin/python that records `-m pip ...` and answers the script's torch probe:
# no torch until a `pip install torch==...` was recorded (or FAKE_TORCH is set).
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "$*" >> "$PIP_LOG"
  case "$*" in *torch==*) touch "$PIP_LOG.torch" ;; esac
  exit 0
fi
if [ "$1" = "-c" ]; then
  case "$2" in *torch*)
    if [ -n "${FAKE_TORCH:-}" ]; then echo "$FAKE_TORCH"; exit 0; fi
    if [ -e "$PIP_LOG.torch" ]; then echo "2.13.0+cpu (CPU build)"; exit 0; fi
    exit 1 ;;
  esac
fi
exec "$REAL_PYTHON" "$@"
"""


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("XLLM_")}
    full["PYTHON"] = sys.executable
    full.update(env or {})
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=full, timeout=60)


@pytest.fixture
def fake_venv(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(FAKE_PYTHON)
    py.chmod(0o755)
    log = tmp_path / "pip.log"
    env = {"XLLM_VENV": str(venv), "PIP_LOG": str(log), "REAL_PYTHON": sys.executable}
    return env, log


def _torch_installs(log: pathlib.Path) -> list[str]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [ln for ln in lines if "torch==" in ln]


def test_dry_run_without_torch_uses_the_cpu_index_and_runs_nothing(tmp_path):
    venv = tmp_path / "new-venv"
    out = _run("--dry-run", env={"XLLM_VENV": str(venv)})
    assert out.returncode == 0, out.stderr
    commands = [ln[2:] for ln in out.stdout.splitlines() if ln.startswith("+ ")]
    assert commands[0] == f"{sys.executable} -m venv {venv}"
    torch = [c for c in commands if "torch==" in c]
    assert torch == [f"{venv}/bin/python -m pip install -q torch==2.13.0 "
                     f"--extra-index-url {CPU_INDEX}"]
    assert commands[-1] == f"{venv}/bin/python -m pip install -q -e .[test,ucx,kvstore]"
    assert "cannot be reached" not in out.stdout  # (a dry run checks no network)
    assert not venv.exists()


def test_dry_run_gpu_takes_pypis_cuda_build(tmp_path):
    out = _run("--dry-run", "--gpu", env={"XLLM_VENV": str(tmp_path / "v")})
    assert out.returncode == 0, out.stderr
    torch = [ln for ln in out.stdout.splitlines() if "torch==" in ln and ln.startswith("+ ")]
    assert len(torch) == 1 and "index" not in torch[0] and "CUDA build" in out.stdout


def test_existing_torch_is_left_alone(fake_venv):
    env, log = fake_venv
    out = _run(env={**env, "FAKE_TORCH": "2.9.0+cu128 (CUDA 12.8 build, a CUDA device: False)"})
    assert out.returncode == 0, out.stderr
    assert _torch_installs(log) == []
    assert "keeping the installed torch 2.9.0+cu128" in out.stdout
    assert "-e .[test,ucx,kvstore]" in log.read_text()
    assert "not what this script installs" not in out.stdout  # (theirs, not ours)


def test_gpu_with_a_cpu_torch_says_how_to_replace_it(fake_venv):
    env, log = fake_venv
    out = _run("--gpu", env={**env, "FAKE_TORCH": "2.13.0+cpu (CPU build)"})
    assert out.returncode == 0, out.stderr
    assert _torch_installs(log) == [] and "pip uninstall -y torch" in out.stdout


def test_reachable_index_is_added_beside_pips_own(fake_venv, tmp_path):
    env, log = fake_venv
    index = tmp_path / "index.html"
    index.write_text("<html></html>")
    out = _run(env={**env, "XLLM_TORCH_INDEX_URL": index.as_uri()})
    assert out.returncode == 0, out.stderr
    assert _torch_installs(log) == [
        f"-m pip install -q torch==2.13.0 --extra-index-url {index.as_uri()}"]
    assert "torch 2.13.0+cpu (CPU build)" in out.stdout  # what it got, said at the end


def test_unreachable_index_falls_back_to_pips_configuration(fake_venv):
    env, log = fake_venv
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    url = f"http://127.0.0.1:{port}/whl/cpu"
    out = _run(env={**env, "XLLM_TORCH_INDEX_URL": url})
    assert out.returncode == 0, out.stderr
    assert _torch_installs(log) == ["-m pip install -q torch==2.13.0"]
    assert f"the torch index {url} cannot be reached from here" in out.stdout


def test_unknown_option_and_old_python(tmp_path):
    out = _run("--bogus")
    assert out.returncode == 2 and "unknown option --bogus" in out.stderr
    old = tmp_path / "python3.9"
    old.write_text("#!/usr/bin/env bash\nif [ \"$1\" = -V ]; then echo Python 3.9.2; fi; exit 1\n")
    old.chmod(0o755)
    out = _run("--dry-run", env={"PYTHON": str(old), "XLLM_VENV": str(tmp_path / "v")})
    assert out.returncode == 2 and "needs Python >= 3.11" in out.stderr
