"""`python -m xllm_py.engine` and `python -m xllm_service`: a user error is one line on
stderr (exit 2) found before the model loads or a port is bound; a PREFILL or DECODE
without a cluster refuses to start. Also the checks themselves (xllm_py.utils.preflight)."""
from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from xllm_py.engine.__main__ import main as engine_main
from xllm_py.utils import preflight
from xllm_py.utils.cli import setup_logging
from xllm_service.__main__ import main as service_main


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ")
    return err


@pytest.mark.parametrize("role", ["PREFILL", "DECODE", "prefill"])
def test_pd_role_without_etcd_refuses(capsys, role):
    assert engine_main(["--instance-role", role, "--port", "0"]) == 2
    err = _one_line(capsys)
    assert f"--instance-role {role.upper()} needs --etcd HOST:PORT" in err
    assert "--instance-role MIX" in err


def test_engine_missing_model(capsys, tmp_path):
    assert engine_main(["--model", str(tmp_path / "none"), "--port", "0"]) == 2
    assert "no such directory, and not a built-in model" in _one_line(capsys)


def test_engine_taken_port(capsys, taken_port):
    assert engine_main(["--port", str(taken_port)]) == 2
    assert f"port {taken_port} on 127.0.0.1 is already in use (--port)" in _one_line(capsys)
    assert engine_main(["--port", "0", "--disagg-pd-port", str(taken_port)]) == 2
    assert "(--disagg-pd-port)" in _one_line(capsys)


def test_service_missing_model_and_taken_ports(capsys, tmp_path, taken_port):
    base = ["--etcd", "127.0.0.1:2379", "--http-port", "0", "--rpc-port", "0"]
    assert service_main([*base, "--model", str(tmp_path / "none")]) == 2
    assert "--model" in _one_line(capsys)
    assert service_main([*base, "--http-port", str(taken_port)]) == 2
    assert "(--http-port)" in _one_line(capsys)
    assert service_main([*base, "--rpc-port", str(taken_port)]) == 2
    assert "(--rpc-port)" in _one_line(capsys)


def test_model_error(tmp_path):
    assert preflight.model_error("tiny") is None
    assert preflight.model_error(str(tmp_path)) is None  # exists: the loader judges its files
    error = preflight.model_error(str(tmp_path / "x"), flag="--model")
    assert error.startswith(f"--model {tmp_path / 'x'}: no such directory")
    assert "tiny-25m" in error  # the built-in names, to pick one
    assert "choose from" in preflight.model_error("tiny-nope")


def test_port_error(taken_port):
    assert preflight.port_error("127.0.0.1", 0, "--port") is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert preflight.port_error("127.0.0.1", free, "--port") is None
    assert "already in use (--port)" in preflight.port_error("127.0.0.1", taken_port, "--port")
    assert "not an address of this machine" in preflight.port_error("192.0.2.1", free, "--p")


def test_reachable_error(taken_port):
    assert preflight.reachable_error(f"127.0.0.1:{taken_port}", "--etcd", "etcd") is None
    assert "expected HOST:PORT" in preflight.reachable_error("nohost", "--etcd", "etcd")


def test_http_server_on_a_taken_port_raises_before_it_says_it_listens(taken_port, caplog):
    """No 'listening' line and no uvicorn sys.exit(3): an OSError the caller turns into
    one line."""
    from fastapi import FastAPI

    from xllm_py.api.server import serve

    with caplog.at_level(logging.INFO, logger="xllm_py.api.server"):
        with pytest.raises(OSError):
            asyncio.run(serve(FastAPI(), "127.0.0.1", taken_port))
    assert "listening" not in caplog.text


def test_request_logs_of_http_clients_are_quiet_unless_debug():
    httpx_logger = logging.getLogger("httpx")
    before = httpx_logger.level
    try:
        setup_logging("INFO")
        assert httpx_logger.getEffectiveLevel() == logging.WARNING
        httpx_logger.setLevel(logging.NOTSET)
        setup_logging("DEBUG")
        assert httpx_logger.level == logging.NOTSET
    finally:
        httpx_logger.setLevel(before)
