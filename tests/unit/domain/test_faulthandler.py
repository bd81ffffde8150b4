"""Every engine, service and worker process entry point turns on faulthandler first thing, so
a native crash (a segfault in torch, gRPC or a C kernel) leaves every thread's Python stack
in the process's log instead of a bare exit status -11."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENTRY_POINTS = {
    "engine": ("xllm_py.engine.__main__", "main(['--help'])"),
    "service": ("xllm_service.__main__", "main(['--help'])"),
    "tp worker": ("xllm_py.parallel.worker", "main(['--help'])"),
    "simulated engines": ("xllm_py.sim.host", "main(['--help'])"),
    "kv peer": ("xllm_py.kv_transfer._peer_main", "sys.argv[1:] = ['--help']; main()"),
}
# --help ends each main at its parser (after faulthandler is on); then a real segfault.
PROGRAM = """
import sys
from {module} import main
try:
    {call}
except SystemExit:
    pass
import ctypes, faulthandler
print("enabled", faulthandler.is_enabled(), flush=True)
ctypes.string_at(0)
"""


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_a_segfault_prints_the_python_stack(name: str) -> None:
    module, call = ENTRY_POINTS[name]
    env = dict(os.environ, PYTHONFAULTHANDLER="")  # only the entry point may turn it on
    env.pop("PYTHONFAULTHANDLER")
    r = subprocess.run([sys.executable, "-c", PROGRAM.format(module=module, call=call)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert "enabled True" in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])
    assert r.returncode == -11, r.returncode
    assert "Fatal Python error: Segmentation fault" in r.stderr, r.stderr[-2000:]
    assert 'File "<string>", line 10 in <module>' in r.stderr, r.stderr[-2000:]
