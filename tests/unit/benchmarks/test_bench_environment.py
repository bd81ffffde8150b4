"""benchmarks.common.report_environment: the versions and machine every benchmark prints."""
from __future__ import annotations

import importlib.metadata
import io
import os
import platform

from benchmarks.common import report_environment, run_environment


def test_run_environment_names_versions_and_machine():
    env = run_environment()
    assert env["python"] == platform.python_version()
    assert env["torch"] == importlib.metadata.version("torch")
    assert env["cpu_model"]
    assert 0 < env["num_cores"] <= env["num_cores_machine"] == os.cpu_count()
    assert env["load_avg_1m"] is None or env["load_avg_1m"] >= 0


def test_report_environment_prints_one_line_and_stores_it():
    out, result = io.StringIO(), {"model": "tiny"}
    env = report_environment(result, file=out)
    assert result == {"model": "tiny", "environment": env}
    line = out.getvalue()
    assert line.count("\n") == 1 and line.startswith("ran with: python ")
    for value in (env["python"], env["torch"], str(env["transformers"]), env["cpu_model"],
                  f"{env['num_cores']} cores"):
        assert value in line
