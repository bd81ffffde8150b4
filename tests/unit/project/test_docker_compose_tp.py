"""docker/docker-compose.tp.yml (prefill TP 2 + decode TP 1 over docker-compose.yml),
checked without a Docker engine: merged onto the base as compose does (a service's
`command` replaced), every engine command line goes through the real parser and builds
its config, the TP prefill is the base prefill plus its TP size only, no two ports of a
container clash (rank r binds the transfer and worker ports + r), and the pair's KV
heads map over a backend that moves head slices."""
from __future__ import annotations

import argparse

import pytest

yaml = pytest.importorskip("yaml")

from tests.unit.project.test_docker_compose import COMPOSE, ENGINE_MODULE, _argv, _parse  # noqa: E402
from xllm_py.engine.cli import build_parser as engine_parser, config_from_args  # noqa: E402
from xllm_py.model.kv_layout import kv_layout, transfer_plan  # noqa: E402
from xllm_py.model.tiny import PRESETS  # noqa: E402

TP_COMPOSE = COMPOSE.parent / "docker-compose.tp.yml"


def _base() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _overlay() -> dict:
    return yaml.safe_load(TP_COMPOSE.read_text())["services"]


def _merged() -> dict:
    merged = {name: dict(svc) for name, svc in _base().items()}
    for name, svc in _overlay().items():
        merged[name].update(svc)  # (command: replaced, as compose does for lists it replaces)
    return merged


def _engine_args(services: dict) -> dict[str, argparse.Namespace]:
    return {n: _parse(engine_parser, _argv(s["command"])[3:]) for n, s in services.items()
            if _argv(s["command"])[:3] == ENGINE_MODULE}


def _backend_class(name: str):
    if name == "tcp":
        from xllm_py.kv_transfer.tcp import TcpKVTransferBackend

        return TcpKVTransferBackend
    from xllm_py.kv_transfer.ucx.backend import UcxKVTransferBackend

    return UcxKVTransferBackend


def test_overlay_only_changes_the_prefill_command() -> None:
    overlay = _overlay()
    assert set(overlay) == {"prefill"}
    assert set(overlay["prefill"]) == {"command"}


def test_engines_parse_with_their_tp_sizes() -> None:
    engines = _engine_args(_merged())
    assert {n: a.tensor_parallel_size for n, a in engines.items()} == {"prefill": 2, "decode": 1}
    for name, args in engines.items():
        config = config_from_args(args)
        assert config.tensor_parallel_size == args.tensor_parallel_size, name


def test_tp_prefill_is_the_base_prefill_with_tp_2() -> None:
    base = vars(_engine_args(_base())["prefill"])
    tp = vars(_engine_args(_merged())["prefill"])
    assert {k for k in tp if tp[k] != base[k]} == {"tensor_parallel_size"}


def test_no_port_clash_in_a_container() -> None:
    for name, a in _engine_args(_merged()).items():
        tp = a.tensor_parallel_size
        ports = [a.port, a.disagg_pd_port,
                 *(a.transfer_listen_port + r for r in range(tp)),
                 *(a.worker_port + r for r in range(tp))]
        assert all(p > 0 for p in ports), name
        assert len(set(ports)) == len(ports), f"{name}: port clash in {sorted(ports)}"


def test_the_pair_can_move_kv_between_its_tp_sizes() -> None:
    engines = _engine_args(_merged())
    prefill, decode = engines["prefill"], engines["decode"]
    for field in ("kv_transfer_backend", "kv_cache_transfer_mode", "model", "block_size"):
        assert getattr(prefill, field) == getattr(decode, field), field
    if prefill.model in PRESETS:
        num_kv_heads = PRESETS[prefill.model]["num_kv_heads"]
    else:  # a packaged model: its config (converted once, cached)
        from xllm_py.model.catalog import resolve_model
        from xllm_py.model.config import ModelConfig

        num_kv_heads = ModelConfig.from_dir(resolve_model(prefill.model, with_weights=False)).num_kv_heads
    transfer_plan(kv_layout(1, num_kv_heads, prefill.tensor_parallel_size),  # raises if not
                  kv_layout(1, num_kv_heads, decode.tensor_parallel_size))
    if prefill.tensor_parallel_size != decode.tensor_parallel_size:
        assert _backend_class(prefill.kv_transfer_backend).supports_head_slices, (
            f"{prefill.kv_transfer_backend} does not move KV head slices (different TP)")
