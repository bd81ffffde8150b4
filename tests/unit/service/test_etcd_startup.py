"""etcd's TLS flags (EtcdTLSConfig) and the start-up check's one line."""
from __future__ import annotations

import pytest

from xllm_py.cluster.etcd_startup import describe
from xllm_py.engine.cli import build_parser as engine_parser
from xllm_py.engine.cli import config_from_args as engine_config
from xllm_py.tls import EtcdTLSConfig
from xllm_service.cli import build_parser as service_parser
from xllm_service.cli import config_from_args as service_config


def test_etcd_tls_flags_are_apart_from_the_cluster_tls(tmp_path):
    ca, cert, key = (tmp_path / n for n in ("ca.pem", "c.pem", "k.pem"))
    for f in (ca, cert, key):
        f.write_text("x")
    assert EtcdTLSConfig.from_args(None, None, None) is None
    assert EtcdTLSConfig.from_args(str(ca), None, None) == EtcdTLSConfig(cacert=str(ca))
    with pytest.raises(ValueError, match="--etcd-cert and --etcd-key together; missing --etcd-key"):
        EtcdTLSConfig.from_args(str(ca), str(cert), None)
    with pytest.raises(ValueError, match="--etcd-cacert: no such file"):
        EtcdTLSConfig.from_args(str(tmp_path / "none.pem"), None, None)
    etcd = ["--etcd", "127.0.0.1:2379", "--etcd-cacert", str(ca), "--etcd-cert", str(cert),
            "--etcd-key", str(key)]
    svc = service_config(service_parser().parse_args(etcd))
    eng = engine_config(engine_parser().parse_args(etcd))
    for config in (svc, eng):
        assert config.security.tls is None  # the cluster's gRPC stays plaintext
        assert config.security.etcd_tls == EtcdTLSConfig(str(ca), str(cert), str(key))
        assert config.security.etcd_tls.flags() == etcd[2:]


def test_the_start_up_line_names_what_to_check():
    ep = "10.0.0.1:2379"
    assert "TLS handshake failed" in describe(ep, True, "UNAVAILABLE: Handshake read failed")
    assert "give --etcd-cacert" in describe(ep, False, "UNAVAILABLE: Socket closed")
    assert "ETCD_USERNAME" in describe(ep, False, "AuthenticationFailed: invalid password")
    line = describe(ep, False, "Failed to connect to remote host: Connection refused")
    assert line.startswith(f"cannot use etcd at {ep}: is etcd running") and "\n" not in line


def test_etcd_takes_a_cluster_s_members_and_a_bad_one_is_a_one_line_error(capsys):
    members = "10.0.0.1:2379, 10.0.0.2:2379,10.0.0.3:2379"
    assert service_config(service_parser().parse_args(["--etcd", members])).etcd_addr \
        == "10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"
    assert engine_config(engine_parser().parse_args(["--etcd", members])).etcd_addr \
        == "10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"
    for parser in (service_parser(), engine_parser()):
        with pytest.raises(SystemExit):
            parser.parse_args(["--etcd", "10.0.0.1:2379,10.0.0.2"])
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert error.endswith("etcd endpoint must be host:port, got '10.0.0.2' in "
                              "'10.0.0.1:2379,10.0.0.2'")


async def test_the_start_up_check_names_every_member_when_none_answers():
    from xllm_py.cluster.etcd_client import EtcdClient
    from xllm_py.cluster.etcd_startup import EtcdStartupError, check_etcd
    from xllm_py.utils.procs import free_port

    members = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    client = EtcdClient(members, timeout_s=0.5)
    try:
        with pytest.raises(EtcdStartupError, match=f"cannot use etcd at {members}: is etcd running"):
            await check_etcd(client, tls=False, wait_s=0.3)
    finally:
        await client.close()
