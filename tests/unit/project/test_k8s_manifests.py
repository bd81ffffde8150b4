"""deploy/k8s, checked without a cluster: both overlays as kustomize builds them
(k8s_render), every object against the Kubernetes 1.34 OpenAPI schema (strict: unknown
fields fail; kubernetes-validate ships the schemas), and every container command line
through the real argument parser of its program, as test_docker_compose does.
"""
from __future__ import annotations

import pathlib
import re

import kubernetes_validate  # the [test] extra (scripts/test.sh installs it): no skip
import pytest

from tests.unit.k8s_render import apply_json_patch, pod_spec, render
from tests.unit.project.test_docker_compose import _etcd_flags, _parse
from xllm_py.config import InstanceRole
from xllm_py.engine.cli import build_parser as engine_parser, config_from_args
from xllm_service.cli import build_parser as service_parser

K8S_VERSION = "1.34.0"
K8S_DIR = pathlib.Path(__file__).resolve().parents[3] / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
ENGINE_MODULE = ["python", "-m", "xllm_py.engine"]
SERVICE_MODULE = ["python", "-m", "xllm_service"]
# What the downward API gives a pod, for $(VAR) in command lines (kubelet expands them).
POD_ENV = {"POD_NAME": "xllm-decode-5d9c7b-x2x9q", "POD_IP": "10.1.2.3"}


@pytest.fixture(scope="module", params=OVERLAYS, ids=[f"overlays/{o}" for o in OVERLAYS])
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S_DIR / "overlays" / request.param)


def _by(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _container(doc: dict) -> dict:
    (c,) = pod_spec(doc)["containers"]
    return c


def _argv(container: dict) -> list[str]:
    """The command line as the kubelet runs it: $(VAR) from the container's env."""
    env = {e["name"]: e for e in container.get("env", [])}
    out = []
    for arg in container["command"] + container.get("args", []):
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in env, f"$({var}) is not in the container's env"
            assert var in POD_ENV, f"$({var}): no sample value in the test"
            arg = arg.replace(f"$({var})", POD_ENV[var])
        out.append(arg)
    return out


def _engines(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"
            and _container(d)["command"][:3] == ENGINE_MODULE}


# --------------------------------------------------------------------------- schema

def test_every_object_validates_against_the_kubernetes_schema(overlay) -> None:
    name, docs = overlay
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["Deployment", "PodDisruptionBudget", "Service", "StatefulSet"], kinds
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{name}: {doc['kind']}/{doc['metadata']['name']}: "
                                 f"{exc.message} at {list(exc.path)}") from None


def test_the_validator_rejects_a_bad_manifest() -> None:
    docs = render(K8S_DIR / "overlays" / "cpu")
    bad = _by(docs, "Deployment", "xllm-decode")
    apply_json_patch(bad, [{"op": "add", "path": "/spec/template/spec/terminationGracePeriod",
                            "value": 60}])  # a typo: unknown field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = _by(render(K8S_DIR / "overlays" / "cpu"), "Deployment", "xllm-decode")
    apply_json_patch(bad, [{"op": "replace", "path": "/spec/replicas", "value": "two"}])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_render_fails_on_a_patch_whose_base_moved() -> None:
    doc = {"spec": {"template": {"spec": {"containers": [{"command": ["a", "b"]}]}}}}
    with pytest.raises(AssertionError, match="patch test failed"):
        apply_json_patch(doc, [{"op": "test", "path": "/spec/template/spec/containers/0/command/1",
                                "value": "c"}])


# --------------------------------------------------------------------------- etcd

def test_etcd_statefulset_on_a_volume(overlay) -> None:
    _, docs = overlay
    sts = _by(docs, "StatefulSet", "etcd")
    svc = _by(docs, "Service", "etcd")
    assert sts["spec"]["serviceName"] == "etcd" and svc["spec"]["clusterIP"] == "None"
    c = _container(sts)
    assert re.fullmatch(r"quay\.io/coreos/etcd:v3\.5\.\d+", c["image"]), c["image"]
    flags = _etcd_flags(_argv(c))
    data_mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert data_mount[claim["metadata"]["name"]] == flags["data-dir"]
    assert flags["advertise-client-urls"] == "http://etcd:2379"
    pod = f"{sts['metadata']['name']}-0"
    assert flags["name"] == pod
    assert flags["initial-cluster"] == f"{pod}={flags['initial-advertise-peer-urls']}"
    assert flags["initial-advertise-peer-urls"] == f"http://{pod}.etcd:2380"


# --------------------------------------------------------------------------- engines

def test_engine_commands_parse(overlay) -> None:
    name, docs = overlay
    engines = _engines(docs)
    roles = {n: _parse(engine_parser, _argv(_container(d))[3:]).instance_role
             for n, d in engines.items()}
    assert roles == {"xllm-prefill": InstanceRole.PREFILL, "xllm-decode": InstanceRole.DECODE}
    for n, d in engines.items():
        c = _container(d)
        args = _parse(engine_parser, _argv(c)[3:])
        config = config_from_args(args)
        assert args.etcd == "etcd:2379"
        # registers under its pod name, advertises its pod IP (downward API)
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]
               if "valueFrom" in e}
        assert env == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}
        assert args.instance_name == POD_ENV["POD_NAME"]
        assert args.advertise_host == POD_ENV["POD_IP"] and args.host == "0.0.0.0"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"http": args.port, "disagg-pd": args.disagg_pd_port,
                         "kv-transfer": args.transfer_listen_port,
                         "kv-worker": args.worker_port}, n
        assert len(set(ports.values())) == 4
        # probes: /health liveness (a draining engine is alive), /readiness readiness
        assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
        # the kubelet waits longer than the drain before SIGKILL
        grace = pod_spec(d)["terminationGracePeriodSeconds"]
        assert 0 < config.drain_timeout_s < grace, (n, config.drain_timeout_s, grace)
        assert d["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        if name == "gpu":
            assert config.device == "cuda" and config.transfer.backend == "ucx"
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
            ucx_tls = {e["name"]: e.get("value") for e in c["env"]}["UCX_TLS"]
            assert {"cuda_copy", "cuda_ipc"} <= set(ucx_tls.split(","))
        else:
            assert config.device == "cpu" and config.transfer.backend == "tcp"
            assert "nvidia.com/gpu" not in str(c["resources"])


def test_prefill_and_decode_agree(overlay) -> None:
    _, docs = overlay
    parsed = [_parse(engine_parser, _argv(_container(d))[3:]) for d in _engines(docs).values()]
    for field in ("kv_transfer_backend", "kv_cache_transfer_mode", "model", "block_size",
                  "dtype", "device"):
        assert len({getattr(a, field) for a in parsed}) == 1, field


def test_engine_parser_rejects_a_typo() -> None:
    with pytest.raises(AssertionError, match="rejected"):
        _parse(engine_parser, ["--instance-role=DECODE", "--instance-nmae=x"])


# --------------------------------------------------------------------------- service

def test_service_deployment(overlay) -> None:
    _, docs = overlay
    dep = _by(docs, "Deployment", "xllm-service")
    assert dep["spec"]["replicas"] == 2  # master election: one master, one standby
    c = _container(dep)
    argv = _argv(c)
    assert argv[:3] == SERVICE_MODULE
    args = _parse(service_parser, argv[3:])
    assert args.etcd == "etcd:2379" and args.host == "0.0.0.0"
    assert args.advertise_host == POD_ENV["POD_IP"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": args.http_port, "grpc": args.rpc_port}
    http = _by(docs, "Service", "xllm-service")["spec"]["ports"]
    grpc = _by(docs, "Service", "xllm-service-grpc")["spec"]["ports"]
    assert [p["targetPort"] for p in http] == ["http"]
    assert [p["targetPort"] for p in grpc] == ["grpc"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    engine_models = {_parse(engine_parser, _argv(_container(d))[3:]).model
                     for d in _engines(docs).values()}
    assert engine_models == {args.model}


def test_every_workload_has_a_disruption_budget_and_requests(overlay) -> None:
    _, docs = overlay
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        labels = d["spec"]["template"]["metadata"]["labels"]
        covering = [p for p in pdbs if p["spec"]["selector"]["matchLabels"].items()
                    <= labels.items()]
        assert len(covering) == 1, d["metadata"]["name"]
        spec = covering[0]["spec"]
        # never all of a workload at once
        assert spec.get("maxUnavailable") == 1 or spec.get("minAvailable", 0) >= 1
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for d in docs:
        spec = pod_spec(d)
        for c in (spec or {}).get("containers", []):
            assert c.get("resources", {}).get("requests"), d["metadata"]["name"]


def test_one_image_for_engines_and_service(overlay) -> None:
    name, docs = overlay
    images = {_container(d)["image"] for d in docs if d["kind"] == "Deployment"}
    assert images == {f"xllm-py:{name}"}
