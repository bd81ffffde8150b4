"""docker/docker-compose.tls.yml (mutual TLS + API keys over docker-compose.yml), checked
without a Docker engine: the overlay is merged onto the base as compose does for these
keys, every command line goes through its real parser, the `certs` one-shot's command is
run (into a temporary folder) and every certificate a service names exists, chains to the
CA and is valid for the host names it is reached by."""
from __future__ import annotations

import pathlib
import re

import pytest

yaml = pytest.importorskip("yaml")

from cryptography import x509  # noqa: E402

from tests.unit.project.test_docker_compose import (COMPOSE, ENGINE_MODULE, SERVICE_MODULE,  # noqa: E402
                                            _argv, _etcd_flags, _parse)
from xllm_py.cluster import certs as certs_cli  # noqa: E402
from xllm_py.engine.cli import build_parser as engine_parser  # noqa: E402
from xllm_py.engine.cli import config_from_args as engine_config  # noqa: E402
from xllm_service.cli import build_parser as service_parser  # noqa: E402
from xllm_service.cli import config_from_args as service_config  # noqa: E402

TLS_COMPOSE = COMPOSE.parent / "docker-compose.tls.yml"
API_KEY = "sk-compose-test"


def _substitute(text: str) -> str:
    """Compose's ${VAR:?message} interpolation, with XLLM_API_KEY set."""
    return re.sub(r"\$\{XLLM_API_KEY:\?[^}]*\}", API_KEY, text)


def _merged() -> dict:
    """Overlay onto base: command/healthcheck replaced, depends_on/volumes merged."""
    base = yaml.safe_load(COMPOSE.read_text())["services"]
    over = yaml.safe_load(_substitute(TLS_COMPOSE.read_text()))["services"]
    merged = {name: dict(svc) for name, svc in base.items()}
    for name, svc in over.items():
        target = merged.setdefault(name, {})
        for key, value in svc.items():
            if key == "depends_on":
                target[key] = {**(target.get(key) or {}), **value}
            elif key == "volumes":
                target[key] = list(dict.fromkeys([*(target.get(key) or []), *value]))
            elif key == "healthcheck":
                target[key] = {**(target.get(key) or {}), **value}
            else:
                target[key] = value
    return merged


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> pathlib.Path:
    """Run the certs one-shot's python command with /certs mapped to a temporary folder."""
    services = _merged()
    script = _argv(services["certs"]["command"])[-1]
    m = re.search(r"python -m xllm_py\.cluster\.certs (.*?)(?:&&|\)|$)", script, re.S)
    assert m, script
    out = tmp_path_factory.mktemp("certs")
    argv = [str(out) if a == "/certs" else a for a in m.group(1).split()]
    assert certs_cli.main(argv) == 0
    return out


def _local(path: str, made: pathlib.Path) -> pathlib.Path:
    assert path.startswith("/certs/"), path
    return made / path.removeprefix("/certs/")


def _check_cert(cert: pathlib.Path, ca: pathlib.Path, host: str) -> None:
    c = x509.load_pem_x509_certificate(cert.read_bytes())
    issuer = x509.load_pem_x509_certificate(ca.read_bytes())
    c.verify_directly_issued_by(issuer)
    names = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert host in names.get_values_for_type(x509.DNSName), (cert.name, host)


def test_every_tls_user_waits_for_certs_and_mounts_them() -> None:
    services = _merged()
    assert set(services) == {"certs", "etcd", "service", "prefill", "decode"}
    for name in ("etcd", "service", "prefill", "decode"):
        deps = services[name]["depends_on"]
        assert deps["certs"] == {"condition": "service_completed_successfully"}, name
        assert "certs:/certs:ro" in services[name]["volumes"], name
    assert set(services["service"]["depends_on"]) == {"certs", "etcd", "prefill", "decode"}


def test_engines_and_service_run_mutual_tls_and_api_keys(made) -> None:
    services = _merged()
    for name, svc in services.items():
        argv = _argv(svc["command"])
        if argv[:3] not in (ENGINE_MODULE, SERVICE_MODULE):
            continue
        engine = argv[:3] == ENGINE_MODULE
        parser, to_config = (engine_parser, engine_config) if engine else (service_parser, service_config)
        args = _parse(parser, argv[3:])
        flags = ("tls_cert", "tls_key", "tls_ca", "etcd_cacert", "etcd_cert", "etcd_key")
        paths = {flag: _local(getattr(args, flag), made) for flag in flags}
        for flag in flags:
            setattr(args, flag, str(paths[flag]))
        config = to_config(args)  # the process builds its config (files exist, triple complete)
        assert config.security.tls is not None and config.security.api_keys == (API_KEY,), name
        # etcd (https, --client-cert-auth) is reached with the process's own identity
        assert paths["etcd_cert"] == paths["tls_cert"] and paths["etcd_cacert"] == paths["tls_ca"]
        assert config.security.etcd_tls is not None, name
        _check_cert(paths["tls_cert"], paths["tls_ca"], args.host)


def test_etcd_serves_https_with_client_certificates(made) -> None:
    etcd = _merged()["etcd"]
    flags = _etcd_flags(_argv(etcd["command"]))
    assert flags["client-cert-auth"] == "true"
    assert flags["advertise-client-urls"] == "https://etcd:2379"
    assert flags["listen-client-urls"].startswith("https://")
    _check_cert(_local(flags["cert-file"], made), _local(flags["trusted-ca-file"], made), "etcd")
    assert _local(flags["key-file"], made).is_file()
    hc = " ".join(_argv(etcd["healthcheck"]["test"])[1:])
    assert "https://" in hc and "--cacert=/certs/ca.pem" in hc and "--cert=" in hc
