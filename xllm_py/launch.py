"""python -m xllm_py.launch: a whole PD cluster on this machine with one command.

Stages: (--tls: a CA and certificates in the log dir) -> etcd (embedded binary, or --etcd)
-> xllm_service -> N prefill + M decode engines
(or K MIX with --mix K) -> wait until the service is ready -> print the endpoint and a
curl -> run until Ctrl-C / SIGTERM -> stop engines, service, etcd; no process left.
"""
from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal
import sys
import tempfile
import threading

from xllm_py.utils.cli import add_flag, setup_logging
from xllm_py.utils.procs import ChildProcess, engine_args, free_port, spawn

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m xllm_py.launch",
        description="Bring up etcd + xllm_service + prefill/decode (or MIX) engines locally.")
    add_flag(p, "--model", default="tiny", help="model directory or 'tiny' (default)")
    add_flag(p, "--prefill", type=int, default=1, help="number of PREFILL engines")
    add_flag(p, "--decode", type=int, default=1, help="number of DECODE engines")
    add_flag(p, "--mix", type=int, default=0, help="run K MIX engines instead of prefill/decode")
    add_flag(p, "--prefill-tp", type=int, default=1,
             help="tensor-parallel size of each PREFILL engine (--tensor-parallel-size)")
    add_flag(p, "--decode-tp", type=int, default=1, help="tensor-parallel size of each DECODE engine")
    add_flag(p, "--mix-tp", type=int, default=1, help="tensor-parallel size of each MIX engine")
    add_flag(p, "--etcd", default=None, help="use this etcd HOST:PORT instead of starting one")
    add_flag(p, "--host", default="127.0.0.1")
    add_flag(p, "--http-port", type=int, default=8888, help="the service's OpenAI API port")
    add_flag(p, "--rpc-port", type=int, default=0, help="the service's gRPC port (0: free)")
    add_flag(p, "--log-dir", default=None, help="folder for one log per process")
    add_flag(p, "--kv-cache-transfer-mode", default="PULL", type=str.upper, choices=["PULL", "PUSH"])
    add_flag(p, "--kv-transfer-backend", default="ucx", choices=["ucx", "tcp"])
    add_flag(p, "--pin-cores", action="store_true",
             help="pin each engine to its own core (round robin over the available cores)")
    add_flag(p, "--ready-timeout", type=float, default=300.0)
    add_flag(p, "--engine-arg", action="append", default=[],
             help="extra flag for every engine, e.g. --engine-arg=--block-size=32")
    add_flag(p, "--prefill-arg", action="append", default=[],
             help="extra flag for the PREFILL engines only (after --engine-arg)")
    add_flag(p, "--decode-arg", action="append", default=[],
             help="extra flag for the DECODE engines only, e.g. "
                  "--decode-arg=--max-prefill-tokens-while-decoding=64")
    add_flag(p, "--service-arg", action="append", default=[],
             help="extra flag for the service, e.g. --service-arg=--load-balance-policy=CACHE_AWARE")
    add_flag(p, "--tls", action="store_true",
             help="mutual TLS inside the cluster: make a CA and certificates in LOG_DIR/certs "
                  "(xllm_py.cluster.certs) and start etcd, the service and the engines with them")
    add_flag(p, "--api-key", action="append", default=None,
             help="API key the service and the engines' HTTP APIs require (repeatable); "
                  "handed to them in a 0600 file in the log dir, not on their command lines")
    add_flag(p, "--log-level", default="INFO")
    return p


def security_args(log_dir: pathlib.Path, tls: bool, api_keys: list[str] | None, host: str,
                  names: tuple[str, ...] = ("service", "engine")) -> dict[str, list[str]]:
    """name -> its security flags; makes the certificates (and etcd's, under "etcd") and
    the key file. Empty lists without --tls and --api-key."""
    flags: dict[str, list[str]] = {name: [] for name in (*names, "etcd")}
    if tls:
        from xllm_py.cluster.certs import LOCAL_HOSTS, make_cluster_certs

        extra_hosts = [] if host in LOCAL_HOSTS else [host]
        issued = make_cluster_certs(log_dir / "certs", (*names, "etcd"), extra_hosts)
        for name, paths in issued.items():
            flags[name] = ["--tls-cert", paths.cert, "--tls-key", paths.key, "--tls-ca", paths.ca]
            if name != "etcd":  # the members reach the (mutual TLS) etcd with their identity
                flags[name] += ["--etcd-cacert", paths.ca, "--etcd-cert", paths.cert,
                                "--etcd-key", paths.key]
    if api_keys:
        key_file = log_dir / "api-keys"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{k}\n" for k in api_keys))
        for name in names:
            flags[name] += ["--api-key-file", str(key_file)]
    return flags


class Cluster:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="xllm-logs-"))
        self.etcd = None
        self.etcd_addr = args.etcd
        self.children: list[ChildProcess] = []
        self.service: ChildProcess | None = None
        self.security: dict[str, list[str]] = {}

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.args.http_port}"

    def start(self) -> None:
        a = self.args
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.security = security_args(self.log_dir, a.tls, a.api_key, a.host)
        if self.etcd_addr is None:
            from xllm_py.cluster.etcd_server import EmbeddedEtcd
            from xllm_py.tls import TLSConfig

            etcd_tls = self.security["etcd"]
            tls = TLSConfig(*etcd_tls[1::2]) if etcd_tls else None
            self.etcd = EmbeddedEtcd(host="127.0.0.1", tls=tls).start()
            self.etcd_addr = self.etcd.endpoint
            logger.info("etcd at %s", self.etcd_addr)
        rpc_port = a.rpc_port or free_port(a.host)
        self.service = spawn("service", "xllm_service",
                             ["--etcd", self.etcd_addr, "--host", a.host, "--http-port",
                              str(a.http_port), "--rpc-port", str(rpc_port), "--model", a.model,
                              *self.security["service"], *a.service_arg],
                             self.log_dir, http_url=self.url)
        self.children.append(self.service)
        roles = [("MIX", i) for i in range(a.mix)] if a.mix else (
            [("PREFILL", i) for i in range(a.prefill)] + [("DECODE", i) for i in range(a.decode)])
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        engines = []
        for n, (role, i) in enumerate(roles):
            port = free_port(a.host)
            tp = {"MIX": a.mix_tp, "PREFILL": a.prefill_tp, "DECODE": a.decode_tp}[role]
            own = {"MIX": [], "PREFILL": a.prefill_arg, "DECODE": a.decode_arg}[role]
            extra = ["--kv-cache-transfer-mode", a.kv_cache_transfer_mode,
                     "--kv-transfer-backend", a.kv_transfer_backend, *self.security["engine"],
                     *(["--tensor-parallel-size", str(tp)] if tp > 1 else []), *a.engine_arg,
                     *own]
            # (a TP engine's ranks need a core each: it is not pinned to one)
            cpu = cores[n % len(cores)] if a.pin_cores and cores and tp == 1 else None
            proc = spawn(f"{role.lower()}-{i}", "xllm_py.engine",
                         engine_args(role, port, etcd=self.etcd_addr, model=a.model,
                                     host=a.host, extra=extra),
                         self.log_dir, http_url=f"http://{a.host}:{port}", cpu=cpu)
            self.children.append(proc)
            engines.append(proc)
        for proc in engines:
            proc.wait_ready(a.ready_timeout)
        self.service.wait_ready(a.ready_timeout, path="/readiness")

    def stop(self) -> None:
        for proc in reversed(self.children):
            if proc.alive():
                proc.popen.send_signal(signal.SIGTERM)
        for proc in reversed(self.children):
            proc.terminate(timeout_s=10)
        if self.etcd is not None:
            self.etcd.stop()

    def failed_child(self) -> ChildProcess | None:
        return next((p for p in self.children if not p.alive()), None)


def tp_error(args: argparse.Namespace) -> str | None:
    """Why the requested TP sizes cannot run (checked before anything starts)."""
    if min(args.prefill_tp, args.decode_tp, args.mix_tp) < 1:
        return "tensor-parallel sizes must be >= 1"
    return None  # (different prefill / decode TP: KV head slices, over ucx or tcp)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    error = tp_error(args)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stop = threading.Event()
    starting = [True]

    def on_signal(*_: object) -> None:
        stop.set()
        if starting[0]:  # interrupt a start-up that may wait minutes for readiness
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cluster = Cluster(args)
    try:
        cluster.start()
        starting[0] = False
        model = args.model.rstrip("/").rsplit("/", 1)[-1] or args.model
        shape = (f"{args.mix} MIX (TP {args.mix_tp})" if args.mix else
                 f"{args.prefill} prefill (TP {args.prefill_tp}) + {args.decode} decode "
                 f"(TP {args.decode_tp})")
        auth = " -H 'Authorization: Bearer <your --api-key>'" if args.api_key else ""
        print(f"\nxllm-py cluster is up ({shape}, model {model})\n"
              f"  OpenAI endpoint: {cluster.url}/v1\n"
              f"  logs:            {cluster.log_dir}\n"
              f"  etcd:            {cluster.etcd_addr}{' (mutual TLS)' if args.tls else ''}\n"
              + (f"  certificates:    {cluster.log_dir / 'certs'}\n" if args.tls else "") + "\n"
              f"Try:\n  curl {cluster.url}/v1/chat/completions{auth} -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": "
              f"\"Hello!\"}}], \"max_tokens\": 32}}'\n\nCtrl-C stops everything.", flush=True)
        while not stop.wait(0.5):
            dead = cluster.failed_child()
            if dead is not None:
                logger.error("%s exited (%s); stopping the cluster. Last log lines:\n%s",
                             dead.name, dead.popen.returncode, dead.log_tail())
                return 1
        return 0
    except KeyboardInterrupt:
        logger.info("interrupted during start-up")
        return 130
    except (RuntimeError, TimeoutError, OSError) as exc:
        logger.error("cluster failed to start: %s", exc)
        return 1
    finally:
        starting[0] = False
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the shutdown finish
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.stop()
        logger.info("stopped; logs in %s", cluster.log_dir)


if __name__ == "__main__":
    sys.exit(main())
