"""Suite-wide settings: `matrix` tests are skipped unless `-m` names that marker (the
default run, scripts/test.sh with no arguments, leaves the long PD matrix out); `gpu` tests
are skipped where CUDA is absent; where it is present,
UCX gets the CUDA transports from the start (it reads its settings once per process, and
host-memory tests import ucxx before the CUDA ones). Every engine process of the run keeps
its disk KV tier in a directory of its own under one of this run (XLLM_KV_TIER_DIR with
{pid}): no test finds blocks an earlier run, or another test's engines, left on disk (the
tests of the disk tier name their directories)."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest


def pytest_configure(config):
    if "XLLM_KV_TIER_DIR" not in os.environ:
        root = tempfile.mkdtemp(prefix="xllm-kv-tiers-")
        os.environ["XLLM_KV_TIER_DIR"] = os.path.join(root, "{pid}")
        config.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))
    try:
        import torch

        if torch.cuda.is_available():
            from xllm_py.kv_transfer.ucx.env import UCX_ENV_DEFAULTS_GPU

            os.environ.setdefault("UCX_TLS", UCX_ENV_DEFAULTS_GPU["UCX_TLS"])
    except Exception:
        pass


def pytest_collection_modifyitems(config, items):
    if "matrix" not in (config.option.markexpr or ""):  # the long run is asked for by name
        skip_matrix = pytest.mark.skip(
            reason='the PD matrix: -m must name it, e.g. -m "integration or matrix"')
        for item in items:
            if item.get_closest_marker("matrix"):
                item.add_marker(skip_matrix)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
