"""etcd's TLS is its own (--etcd-cacert/--etcd-cert/--etcd-key, etcdctl's spellings), apart
from the cluster's gRPC TLS (--tls-*); and an etcd that cannot be reached or spoken to at
start-up ends the service or engine with one line (it used to retry forever: with --tls-*
against a plaintext etcd, "Handshake read failed" twice a second and never registered)."""
from __future__ import annotations

import time

import pytest

from tests.integration.cluster_harness import Harness, labelled
from tests.waiting import wait_until_sync
from xllm_py.cluster.certs import make_cluster_certs
from xllm_py.cluster.etcd_server import EmbeddedEtcd
from xllm_py.tls import TLSConfig
from xllm_py.utils.procs import free_port, spawn

pytestmark = pytest.mark.integration


def _tls_flags(issued) -> list[str]:
    return ["--tls-cert", issued.cert, "--tls-key", issued.key, "--tls-ca", issued.ca]


def _etcd_flags(issued) -> list[str]:
    return ["--etcd-cacert", issued.ca, "--etcd-cert", issued.cert, "--etcd-key", issued.key]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    root = tmp_path_factory.mktemp("certs")
    return {"cluster": make_cluster_certs(root / "cluster", names=("service", "engine")),
            "etcd": make_cluster_certs(root / "etcd", names=("etcd", "service", "engine"))}


@pytest.fixture(scope="module")
def tls_etcd(certs):
    """An etcd serving https with a CA of its own, asking for client certificates."""
    own = certs["etcd"]["etcd"]
    etcd = EmbeddedEtcd(tls=TLSConfig(cert=own.cert, key=own.key, ca=own.ca)).start()
    try:
        yield etcd
    finally:
        etcd.stop()


def _cluster_joins(h: Harness, service_flags: list[str], engine_flags: list[str]) -> None:
    svc = h.service(extra=service_flags)
    engine = h.engine("MIX", "mix", extra=["--block-size", "8", "--num-blocks", "256",
                                           *engine_flags])
    engine.wait_ready(180)
    svc.wait_ready(60, path="/readiness")
    wait_until_sync(lambda: labelled(svc.http_url, "xllm_service_instances",
                                     'state="ACTIVE"') == 1, 60, step_s=0.2)


def test_cluster_tls_leaves_a_plaintext_etcd_plaintext(etcd_endpoint, etcd_namespace, certs,
                                                       tmp_path):
    """--tls-* secures the cluster's gRPC only: the service and a MIX engine under mutual
    TLS register through a plaintext etcd (before: the etcd client spoke TLS too and the
    engine never registered)."""
    c = certs["cluster"]
    h = Harness(etcd_endpoint, etcd_namespace, tmp_path / "logs")
    try:
        _cluster_joins(h, _tls_flags(c["service"]), _tls_flags(c["engine"]))
    finally:
        h.stop()


def test_etcd_with_a_ca_of_its_own(tls_etcd, certs, tmp_path):
    """etcd's CA differs from the cluster's: each set of flags goes to its own peer."""
    c, e = certs["cluster"], certs["etcd"]
    h = Harness(tls_etcd.endpoint, "own-ca/", tmp_path / "logs")
    try:
        _cluster_joins(h, [*_tls_flags(c["service"]), *_etcd_flags(e["service"])],
                       [*_tls_flags(c["engine"]), *_etcd_flags(e["engine"])])
    finally:
        h.stop()


def _ends_with_one_line(name: str, module: str, args: list[str], log_dir, expect: str,
                        bound_s: float) -> tuple[float, str]:
    """(seconds it ran, its log)."""
    t0 = time.monotonic()
    proc = spawn(name, module, args, log_dir)
    try:
        rc = proc.popen.wait(bound_s)
    except Exception:
        proc.kill()
        raise AssertionError(f"{name} still running after {bound_s}s:\n{proc.log_tail()}")
    took = time.monotonic() - t0
    log = proc.log_path.read_text()
    ours = [line for line in log.splitlines() if "cannot use etcd at" in line]
    assert rc == 1, log
    assert len(ours) == 1 and ours[0].startswith(f"{module}: cannot use etcd at"), log
    assert expect in ours[0], ours[0]
    assert "Traceback" not in log, log
    return took, log


def test_an_etcd_spoken_to_wrongly_ends_the_process_with_one_line(
        etcd_endpoint, tls_etcd, certs, tmp_path):
    e = certs["etcd"]["service"]
    svc = lambda etcd, *extra: ["--etcd", etcd, "--http-port", str(free_port()),  # noqa: E731
                                "--rpc-port", "0", *extra]
    logs = tmp_path / "logs"
    # TLS to a plaintext etcd: at once (no retry mends a handshake)
    _, log = _ends_with_one_line("svc-tls-to-plain", "xllm_service",
                                 svc(etcd_endpoint, "--etcd-cacert", e.ca), logs,
                                 "TLS handshake failed", 20)
    assert "not answering yet" not in log, log
    # plaintext to an https etcd
    _ends_with_one_line("svc-plain-to-tls", "xllm_service", svc(tls_etcd.endpoint), logs,
                        "does it serve https", 20)
    # https etcd, a certificate from another CA
    other = certs["cluster"]["service"]
    _ends_with_one_line("svc-other-ca", "xllm_service",
                        svc(tls_etcd.endpoint, *_etcd_flags(other)), logs,
                        "TLS handshake failed", 20)
    # nothing there: after the start-up wait (an etcd may be starting beside us)
    took, log = _ends_with_one_line("svc-unreachable", "xllm_service",
                                    svc(f"127.0.0.1:{free_port()}"), logs,
                                    "is etcd running at", 30)
    assert took >= 9 and "not answering yet" in log, log
    # an engine checks before it loads its weights
    _ends_with_one_line("engine-tls-to-plain", "xllm_py.engine",
                        ["--instance-role", "MIX", "--model", "tiny", "--port",
                         str(free_port()), "--etcd", etcd_endpoint, "--etcd-cacert", e.ca],
                        logs, "TLS handshake failed", 60)
