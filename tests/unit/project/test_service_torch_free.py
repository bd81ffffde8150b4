"""The master imports no torch, no transformers and no engine beyond the torch-free
prefix-hash helpers, and gets a tiny model's tokenizer and config without torch."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

from xllm_py.model.tiny import ensure_tiny_model

# Everything `python -m xllm_service` imports, including what run_service imports when
# it starts.
SERVICE_MODULES = (
    "xllm_service.__main__", "xllm_service.server", "xllm_service.backend",
    "xllm_service.cli", "xllm_service.election", "xllm_service.engine_client",
    "xllm_service.instance_table", "xllm_service.metrics", "xllm_service.prefix_index",
    "xllm_service.registry", "xllm_service.router", "xllm_service.rpc_service",
    "xllm_service.sub_request", "xllm_service.response_store", "xllm_py.api.app",
    "xllm_py.api.server",
    "xllm_py.cluster.etcd_client", "xllm_py.model.config", "xllm_py.model.tiny",
    "xllm_py.model.tokenizer", "xllm_py.rpc.service",
)
# Engine modules the service may use: the prefix-cache hash chain (pure Python).
ENGINE_ALLOWED = {"xllm_py.engine", "xllm_py.engine.block_pool", "xllm_py.engine.cache_events"}


def _run(code: str, env: dict | None = None) -> dict:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, env=env, timeout=120)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_service_imports_neither_torch_nor_transformers_nor_the_engine():
    code = (
        "import importlib, json, sys\n"
        f"for m in {SERVICE_MODULES!r}: importlib.import_module(m)\n"
        "print(json.dumps({'heavy': sorted(m for m in ('torch', 'transformers') if m in sys.modules),"
        " 'engine': sorted(m for m in sys.modules if m.startswith('xllm_py.engine'))}))"
    )
    got = _run(code)
    assert got["heavy"] == []
    assert set(got["engine"]) <= ENGINE_ALLOWED, got["engine"]


def _digest(path) -> dict[str, str]:
    names = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    return {n: hashlib.sha256((path / n).read_bytes()).hexdigest() for n in names}


def test_tiny_model_files_without_torch_match_the_full_model(tmp_path):
    """The service builds a tiny model's files without weights (no torch); they equal the
    full model's, so the service tokenizes as the engines do."""
    env = dict(os.environ, XLLM_CACHE_DIR=str(tmp_path / "svc"))
    code = (
        "import json, pathlib, sys\n"
        "from xllm_py.model.tiny import model_files_dir\n"
        "from xllm_py.model.config import ModelConfig\n"
        "from xllm_py.model.tokenizer import Tokenizer\n"
        "d = model_files_dir('tiny')\n"
        "tok = Tokenizer.from_dir(d); cfg = ModelConfig.from_dir(d)\n"
        "print(json.dumps({'dir': d, 'torch': 'torch' in sys.modules,"
        " 'files': sorted(p.name for p in pathlib.Path(d).iterdir()),"
        " 'ids': tok.encode('Hello there'), 'max_len': cfg.max_position_embeddings}))"
    )
    got = _run(code, env)
    assert not got["torch"]
    assert got["dir"] == str(tmp_path / "svc" / "tiny.noweights")
    assert "model.safetensors" not in got["files"] and "tokenizer.json" in got["files"]
    assert got["max_len"] == 2048 and got["ids"]
    files = tmp_path / "svc" / "tiny.noweights"
    full = ensure_tiny_model("tiny", cache_dir=tmp_path / "full")
    assert _digest(files) == _digest(full)
    # Once the full model is built, the service uses its directory.
    assert ensure_tiny_model("tiny", cache_dir=tmp_path / "full", with_weights=False) == full
