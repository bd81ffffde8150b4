"""API keys on the OpenAI HTTP API (xllm_py.api.auth): 401 with an OpenAI body without a
valid bearer key; probes open; /metrics open unless protected; keys never in logs or reprs;
the service's and the engine's flags build the same SecurityConfig."""
from __future__ import annotations

import logging

import httpx
import pytest

from xllm_py.api.app import build_app
from xllm_py.api.auth import APIKeys
from xllm_py.api.testing import ScriptedBackend
from xllm_py.engine import cli as engine_cli
from xllm_py.utils.security_cli import collect_api_keys
from xllm_service import cli as service_cli

KEYS = ("sk-first-key", "sk-second-key")
BODY = {"prompt": "hi", "max_tokens": 2}


def _client(**kwargs) -> httpx.AsyncClient:
    app = build_app(ScriptedBackend(), **kwargs)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-first-key"},
    {"Authorization": "Basic sk-first-key"}, {"Authorization": "Bearer "},
    {"Authorization": "Bearer sk-first-keyX"}])
async def test_requests_without_a_valid_key_get_401_with_an_openai_body(headers) -> None:
    async with _client(api_keys=KEYS) as c:
        for method, path in (("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                             ("get", "/v1/models"), ("get", "/no-such-route")):
            r = await (c.post(path, json=BODY, headers=headers) if method == "post"
                       else c.get(path, headers=headers))
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert r.headers["www-authenticate"] == "Bearer"


async def test_every_configured_key_is_accepted() -> None:
    async with _client(api_keys=KEYS) as c:
        for key in KEYS:
            r = await c.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            r = await c.get("/v1/models", headers={"authorization": f"bearer {key}"})
            assert r.status_code == 200


async def test_probes_are_open_and_metrics_open_unless_protected() -> None:
    async with _client(api_keys=KEYS) as c:
        for path in ("/health", "/readiness", "/metrics"):
            assert (await c.get(path)).status_code == 200, path
    async with _client(api_keys=KEYS, protect_metrics=True) as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 401
        ok = await c.get("/metrics", headers={"Authorization": f"Bearer {KEYS[1]}"})
        assert ok.status_code == 200


async def test_without_keys_the_api_is_open() -> None:
    async with _client() as c:
        assert (await c.post("/v1/completions", json=BODY)).status_code == 200


def test_keys_from_flags_and_file_never_in_reprs(tmp_path, caplog) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nsk-from-file\n\nsk-first-key\n")
    caplog.set_level(logging.DEBUG)
    for cli, base in ((service_cli, ["--etcd", "127.0.0.1:2379"]), (engine_cli, [])):
        args = cli.build_parser().parse_args(
            base + ["--api-key", "sk-first-key", "--api_key", "sk-second-key",
                    "--api-key-file", str(key_file), "--protect-metrics", "true"])
        config = cli.config_from_args(args)
        assert config.security.api_keys == ("sk-first-key", "sk-second-key", "sk-from-file")
        assert config.security.protect_metrics and config.security.tls is None
        assert "sk-" not in repr(config)
    assert "sk-" not in repr(APIKeys(KEYS))
    assert "sk-" not in caplog.text


def test_bad_key_flags_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        collect_api_keys([" "], None)
    empty = tmp_path / "empty"
    empty.write_text("\n# nothing\n")
    with pytest.raises(ValueError, match="no key in the file"):
        collect_api_keys(None, str(empty))
    with pytest.raises(ValueError, match="no-such-file"):
        collect_api_keys(None, str(tmp_path / "no-such-file"))


def test_tls_flags_need_all_three_files(tmp_path) -> None:
    from xllm_py.cluster.certs import make_cluster_certs

    issued = make_cluster_certs(tmp_path, names=("engine",))["engine"]
    parser = engine_cli.build_parser()
    config = engine_cli.config_from_args(parser.parse_args(
        ["--tls-cert", issued.cert, "--tls-key", issued.key, "--tls-ca", issued.ca]))
    assert config.security.tls.cert == issued.cert and config.security.tls.ca == issued.ca
    with pytest.raises(ValueError, match="missing --tls-ca"):
        engine_cli.config_from_args(parser.parse_args(
            ["--tls-cert", issued.cert, "--tls-key", issued.key]))


def test_launch_security_args_make_certs_and_a_private_key_file(tmp_path) -> None:
    import stat

    from xllm_py.launch import build_parser as launch_parser
    from xllm_py.launch import security_args

    assert launch_parser().parse_args(["--tls", "--api-key", "k1"]).tls
    assert security_args(tmp_path / "plain", False, None, "127.0.0.1") == {
        "service": [], "engine": [], "etcd": []}
    flags = security_args(tmp_path, True, ["sk-a", "sk-b"], "10.1.2.3")
    key_file = tmp_path / "api-keys"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    service = service_cli.config_from_args(service_cli.build_parser().parse_args(
        ["--etcd", "127.0.0.1:2379", *flags["service"]]))
    engine = engine_cli.config_from_args(engine_cli.build_parser().parse_args(flags["engine"]))
    for config in (service, engine):
        assert config.security.api_keys == ("sk-a", "sk-b")
        assert config.security.tls.ca == str(tmp_path / "certs" / "ca.pem")
    assert flags["etcd"][1::2] == [str(tmp_path / "certs" / f) for f in ("etcd.pem", "etcd-key.pem", "ca.pem")]
    assert not any("sk-" in f for fl in flags.values() for f in fl)  # keys travel in the file only
