"""The launcher's checks before anything starts: each user error is one line on stderr,
exit status 2, and no etcd, service or engine was started (no log dir was made)."""
from __future__ import annotations

import signal
import socket

import pytest

from xllm_py import launch
from xllm_py.launch import Cluster, build_parser, main


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return port  # nothing listens there now


def _refused(capsys, tmp_path, *argv: str) -> str:
    log_dir = tmp_path / "logs"
    assert main(["--log-dir", str(log_dir), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ")
    assert not log_dir.exists() or not any(log_dir.iterdir())  # nothing started
    return err


def test_missing_model_is_one_line_before_anything_starts(capsys, tmp_path):
    err = _refused(capsys, tmp_path, "--model", str(tmp_path / "nonexistent"))
    assert "no such directory" in err and "built-in name" in err and "tiny" in err


def test_unknown_builtin_name(capsys, tmp_path):
    assert "unknown tiny model 'tiny-x'" in _refused(capsys, tmp_path, "--model", "tiny-x")


def test_taken_http_port(capsys, tmp_path, taken_port):
    err = _refused(capsys, tmp_path, "--http-port", str(taken_port))
    assert f"port {taken_port} on 127.0.0.1 is already in use (--http-port)" in err
    assert "pass another --http-port" in err


def test_taken_rpc_port(capsys, tmp_path, taken_port):
    err = _refused(capsys, tmp_path, "--http-port", "0", "--rpc-port", str(taken_port))
    assert "(--rpc-port)" in err


def test_unreachable_etcd(capsys, tmp_path, closed_port):
    err = _refused(capsys, tmp_path, "--etcd", f"127.0.0.1:{closed_port}")
    assert f"cannot reach etcd at 127.0.0.1:{closed_port} (--etcd)" in err
    assert "leave --etcd out" in err


def test_etcd_members_one_answering_is_enough(taken_port, closed_port):
    from xllm_py.launch import etcd_members_error

    assert etcd_members_error(f"127.0.0.1:{closed_port},127.0.0.1:{taken_port}") is None
    error = etcd_members_error(f"127.0.0.1:{closed_port},127.0.0.1:{closed_port}")
    assert f"cannot reach etcd at 127.0.0.1:{closed_port} (--etcd)" in error


def test_an_etcd_url_is_taken_as_its_host_and_port(capsys, tmp_path, taken_port, closed_port):
    args = build_parser().parse_args(
        ["--etcd", f"http://127.0.0.1:{closed_port},https://127.0.0.1:{taken_port}"])
    assert args.etcd == f"127.0.0.1:{closed_port},127.0.0.1:{taken_port}"
    assert launch.etcd_members_error(args.etcd) is None
    err = _refused(capsys, tmp_path, "--etcd", f"http://127.0.0.1:{closed_port}")
    assert f"cannot reach etcd at 127.0.0.1:{closed_port} (--etcd)" in err


def test_bad_engine_and_service_flags_found_by_their_own_parsers(capsys, tmp_path):
    err = _refused(capsys, tmp_path, "--engine-arg=--blok-size=32")
    assert "unrecognized arguments: --blok-size=32" in err and "--engine-arg" in err
    err = _refused(capsys, tmp_path, "--decode-arg=--block-size=many")
    assert err.startswith("error: DECODE engine flags") and "invalid int value" in err
    err = _refused(capsys, tmp_path, "--service-arg=--load-balance-policy=FOO")
    assert "service flags (--service-arg)" in err and "invalid choice: 'FOO'" in err


def test_service_settings_pass_through_as_its_config_file(capsys, tmp_path):
    settings = tmp_path / "service.yaml"
    settings.write_text("evict_grace_s: 5\ndisagg_decision: ALWAYS\n")
    args = build_parser().parse_args(["--http-port", "0", f"--service-arg=--config={settings}"])
    assert launch.preflight(args) is None
    err = _refused(capsys, tmp_path, "--service-arg=--evict-grace-s=5")
    assert "service flags (--service-arg)" in err and "'evict_grace_s: VALUE'" in err
    settings.write_text("evict_grace_s: soon\n")
    err = _refused(capsys, tmp_path, f"--service-arg=--config={settings}")
    assert "service flags (--service-arg)" in err and "evict_grace_s" in err


def test_no_engines(capsys, tmp_path):
    assert "--prefill >= 1 and --decode >= 1" in _refused(capsys, tmp_path, "--decode", "0")


def test_log_dir_that_is_a_file(capsys, tmp_path):
    file = tmp_path / "f"
    file.write_text("")
    assert main(["--log-dir", str(file)]) == 2
    assert "cannot use --log-dir" in capsys.readouterr().err


def test_good_flags_pass(tmp_path):
    args = build_parser().parse_args(["--http-port", "0", "--engine-arg=--block-size=32",
                                      "--service-arg=--load-balance-policy=CACHE_AWARE"])
    assert launch.preflight(args) is None


def test_help_shows_defaults_and_every_flag_has_help(capsys):
    parser = build_parser()
    missing = [a.option_strings[0] for a in parser._actions if not a.help]
    assert not missing, f"flags without help text: {missing}"
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "(default: 8888)" in out and "(default: 300.0)" in out
    assert f"(default: {parser.get_default('model')})" in out
    assert "(default: None)" not in out and "(default: [])" not in out
    assert "HTTP_PORT, --http_port" not in out  # underscore spellings work, but do not double the help


class _FakeChild:
    """Records signals and waits; 'exits' on SIGTERM."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.running = name, log, True
        self.popen = self

    def alive(self) -> bool:
        return self.running

    def send_signal(self, sig: int) -> None:
        assert sig == signal.SIGTERM
        self.log.append(f"term {self.name}")

    def terminate(self, timeout_s: float) -> int:
        self.log.append(f"wait {self.name}")
        self.running = False
        return 0


def test_stop_ends_the_engines_before_the_service(tmp_path):
    """So no engine's heartbeat meets a service that is gone (an UNAVAILABLE warning at
    every clean shutdown)."""
    cluster = Cluster(build_parser().parse_args(["--log-dir", str(tmp_path)]))
    log: list[str] = []
    cluster.service = _FakeChild("service", log)
    cluster.children = [cluster.service, _FakeChild("prefill-0", log), _FakeChild("decode-0", log)]
    cluster.stop()
    assert log.index("wait prefill-0") < log.index("term service")
    assert log.index("wait decode-0") < log.index("term service")
    assert log[-2:] == ["term service", "wait service"]
