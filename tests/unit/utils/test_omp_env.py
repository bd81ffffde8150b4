"""The engine's entry point sets its OpenMP defaults before the server module (torch)
loads (xllm_py/utils/omp_env.py); a value in the environment wins."""
from __future__ import annotations

import os

import pytest

import xllm_py.engine.__main__ as engine_main
from xllm_py.utils.omp_env import OMP_ENV_DEFAULTS
from xllm_py.utils.procs import free_port


def _env_when_served(monkeypatch) -> str | None:
    seen = {}

    def run_async(coro) -> None:  # instead of serving: what the server would start with
        seen["GOMP_SPINCOUNT"] = os.environ.get("GOMP_SPINCOUNT")
        coro.close()

    monkeypatch.setattr(engine_main, "run_async", run_async)
    assert engine_main.main(["--model", "tiny", "--port", str(free_port())]) == 0
    return seen["GOMP_SPINCOUNT"]


def test_the_engine_bounds_libgomps_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOMP_SPINCOUNT", "")  # (so that the test's end restores the
    monkeypatch.delenv("GOMP_SPINCOUNT")      # environment the main() call changes)
    assert _env_when_served(monkeypatch) == OMP_ENV_DEFAULTS["GOMP_SPINCOUNT"] == "10000"


def test_a_spin_count_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert _env_when_served(monkeypatch) == "300000"
