"""python -m xllm_py.launch: a whole PD cluster on this machine with one command.

Stages: (--tls: a CA and certificates in the log dir) -> etcd (embedded binary, or --etcd)
-> the Mooncake Store (its master and a segment host; --kv-store) -> xllm_service -> N
prefill + M decode engines (or K MIX with --mix K) -> wait until the service is ready ->
print the endpoint and a curl -> run until Ctrl-C / SIGTERM -> stop engines, service,
store, etcd; no process left.

The children's own flags pass through (--engine-arg, --prefill-arg, --decode-arg,
--service-arg), their settings files too (--service-arg=--config=FILE); each child's
command line goes through its real parser before anything starts.
"""
from __future__ import annotations

import argparse
import logging
import os
import pathlib
import re
import signal
import sys
import tempfile
import time

from xllm_py.model.catalog import DEFAULT_MODEL
from xllm_py.utils.cli import DefaultsHelpFormatter, add_flag, etcd_endpoints, setup_logging
from xllm_py.utils.procs import ChildProcess, engine_args, free_port, spawn

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m xllm_py.launch",
        description="Bring up etcd + xllm_service + prefill/decode (or MIX) engines locally. "
                    "Flags also accept underscores (--http_port).",
        formatter_class=DefaultsHelpFormatter)
    add_flag(p, "--model", default=DEFAULT_MODEL,
             help="a model directory, a .gguf file, or a name: gemma-3-270m (from its PyPI "
                  "package), tiny, tiny-25m (test models)")
    add_flag(p, "--prefill", type=int, default=1, help="number of PREFILL engines")
    add_flag(p, "--decode", type=int, default=1, help="number of DECODE engines")
    add_flag(p, "--mix", type=int, default=0, help="run K MIX engines instead of prefill/decode")
    add_flag(p, "--prefill-tp", type=int, default=1,
             help="tensor-parallel size of each PREFILL engine (--tensor-parallel-size)")
    add_flag(p, "--decode-tp", type=int, default=1, help="tensor-parallel size of each DECODE engine")
    add_flag(p, "--mix-tp", type=int, default=1, help="tensor-parallel size of each MIX engine")
    add_flag(p, "--etcd", default=None, type=etcd_endpoints,
             help="use this etcd HOST:PORT, or an etcd cluster's HOST:PORT,HOST:PORT,... "
                  "(default: start one, embedded)")
    add_flag(p, "--host", default="127.0.0.1",
             help="address every process listens on (loopback: this machine only)")
    add_flag(p, "--http-port", type=int, default=8888, help="the service's OpenAI API port")
    add_flag(p, "--rpc-port", type=int, default=0, help="the service's gRPC port (0: free)")
    add_flag(p, "--log-dir", default=None,
             help="folder for one log per process (default: a new folder under the temp dir)")
    add_flag(p, "--kv-cache-transfer-mode", default="PULL", type=str.upper, choices=["PULL", "PUSH"],
             help="PULL: decode fetches the prompt's KV from prefill; PUSH: prefill writes it")
    add_flag(p, "--kv-transfer-backend", default="ucx", choices=["ucx", "tcp"],
             help="how KV blocks move between engines")
    add_flag(p, "--kv-store", default="embedded", metavar="embedded|off|HOST:PORT",
             help="the Mooncake Store every engine shares KV blocks through: embedded starts "
                  "one (its master and a segment host; metadata in etcd), HOST:PORT uses that "
                  "master, off runs the engines with their local tiers only")
    add_flag(p, "--kv-store-mb", type=int, default=None,
             help="memory of the embedded store (default: 1/8 of the memory available, at "
                  "most 8192)")
    add_flag(p, "--pin-cores", nargs="?", const="on", default="auto",
             choices=["auto", "on", "off"],
             help="auto: when there are no more engines than cores, each engine gets cores "
                  "of its own (an equal share; its torch threads follow), so engines do not "
                  "fight over cores (their latency profiles and steps stay true); on: also "
                  "when there are more (round robin, one core each); off: never")
    add_flag(p, "--ready-timeout", type=float, default=300.0,
             help="seconds to wait for every engine and the service to be ready")
    add_flag(p, "--engine-arg", action="append", default=[],
             help="extra flag for every engine, e.g. --engine-arg=--block-size=32")
    add_flag(p, "--prefill-arg", action="append", default=[],
             help="extra flag for the PREFILL engines only (given after the --engine-arg ones)")
    add_flag(p, "--decode-arg", action="append", default=[],
             help="extra flag for the DECODE engines only, e.g. "
                  "--decode-arg=--config=decode.yaml (engine settings: python -m xllm_py.engine --help)")
    add_flag(p, "--service-arg", action="append", default=[],
             help="extra flag for the service, e.g. --service-arg=--load-balance-policy=CACHE_AWARE")
    add_flag(p, "--tls", action="store_true",
             help="mutual TLS inside the cluster: make a CA and certificates in LOG_DIR/certs "
                  "(xllm_py.cluster.certs) and start etcd, the service and the engines with them")
    add_flag(p, "--api-key", action="append", default=None,
             help="API key the service and the engines' HTTP APIs require (repeatable); "
                  "handed to them in a 0600 file in the log dir, not on their command lines")
    add_flag(p, "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (the launcher's own)")
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
        self.store = None  # EmbeddedMooncake
        self.kv_store: str | None = None if args.kv_store in ("off", "embedded") else args.kv_store

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.args.http_port}"

    def start(self) -> None:
        a = self.args
        self.log_dir.mkdir(parents=True, exist_ok=True)
        from xllm_py.model.catalog import resolve_model

        # a packaged model or a .gguf is converted here, once, before any process waits on it
        resolve_model(a.model)
        self.security = security_args(self.log_dir, a.tls, a.api_key, a.host)
        if self.etcd_addr is None:
            from xllm_py.cluster.etcd_server import EmbeddedEtcd
            from xllm_py.tls import TLSConfig

            etcd_tls = self.security["etcd"]
            tls = TLSConfig(*etcd_tls[1::2]) if etcd_tls else None
            self.etcd = EmbeddedEtcd(host="127.0.0.1", tls=tls).start()
            self.etcd_addr = self.etcd.endpoint
            logger.info("etcd at %s", self.etcd_addr)
        if a.kv_store == "embedded":
            self._start_store()
        rpc_port = a.rpc_port or free_port(a.host)
        self.service = spawn("service", "xllm_service",
                             service_argv(a, self.etcd_addr, rpc_port, self.security["service"]),
                             self.log_dir, http_url=self.url)
        self.children.append(self.service)
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        roles = engine_roles(a)
        shares = core_shares(a.pin_cores, cores, [engine_tp(a, role) for role, _ in roles])
        engines = []
        for (role, i), cpu in zip(roles, shares):
            port = free_port(a.host)
            proc = spawn(f"{role.lower()}-{i}", "xllm_py.engine",
                         engine_args(role, port, etcd=self.etcd_addr, model=a.model, host=a.host,
                                     extra=engine_flags(a, role, self.security["engine"],
                                                        self.kv_store)),
                         self.log_dir, http_url=f"http://{a.host}:{port}", cpu=cpu)
            self.children.append(proc)
            engines.append(proc)
        self._wait_ready([(p, "/health") for p in engines] + [(self.service, "/readiness")],
                         a.ready_timeout)

    def _start_store(self) -> None:
        """The embedded Mooncake Store, where this machine can run one (else one line
        saying what to install, and the engines keep their local tiers)."""
        from xllm_py.engine.kv_tiering_setup import HOST_MAX, HOST_SHARE, available_memory_bytes
        from xllm_py.kv_tiers.embedded import EmbeddedMooncake, store_unavailable

        why = ("the cluster's etcd uses TLS (give --kv-store HOST:PORT and the engines "
               "--kv-store-metadata)" if self.args.tls else store_unavailable())
        if why:
            logger.warning("KV store off: %s", why)
            return
        size_mb = self.args.kv_store_mb or min(HOST_MAX, available_memory_bytes() // HOST_SHARE) >> 20
        self.store = EmbeddedMooncake(self.etcd_addr, self.log_dir, host=self.args.host,
                                      size_mb=max(size_mb, 64)).start()
        self.kv_store = self.store.master_addr

    def _wait_ready(self, waits: list[tuple[ChildProcess, str]], timeout_s: float) -> None:
        """Each child ready in turn, watching them all: one that exits ends the wait."""
        deadline = time.monotonic() + timeout_s
        for proc, path in waits:
            while True:
                dead = self.failed_child()
                if dead is not None:
                    raise RuntimeError(f"{dead.name} exited with {dead.popen.returncode}")
                try:
                    proc.wait_ready(min(1.0, max(deadline - time.monotonic(), 0.05)), path=path)
                    break
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise

    def stop(self) -> None:
        """Engines first (they drain, deregister and stop heartbeating while the service
        still answers), then the service, then etcd."""
        engines = [p for p in self.children if p is not self.service]
        for group in (engines, [self.service] if self.service else []):
            for proc in group:
                if proc.alive():
                    proc.popen.send_signal(signal.SIGTERM)
            for proc in group:
                proc.terminate(timeout_s=10)
        if self.store is not None:
            self.store.stop()
        if self.etcd is not None:
            self.etcd.stop()

    def failed_child(self) -> ChildProcess | None:
        return next((p for p in self.children if not p.alive()), None)


def engine_tp(a: argparse.Namespace, role: str) -> int:
    return {"MIX": a.mix_tp, "PREFILL": a.prefill_tp, "DECODE": a.decode_tp}[role]


def core_shares(mode: str, cores: list[int], tps: list[int]) -> list[list[int] | None]:
    """The cores each engine is pinned to (None: not pinned). `auto`: when the engines are
    no more than the cores and all TP 1 (a TP engine's ranks are processes of their own),
    engine k gets the k-th of len(tps) equal slices of `cores`; `on`: one core each, round
    robin (TP 1 engines); `off`: none."""
    n = len(tps)
    if mode == "off" or not cores or not n:
        return [None] * n
    if mode == "on":
        return [[cores[k % len(cores)]] if tp == 1 else None for k, tp in enumerate(tps)]
    if n > len(cores) or any(tp != 1 for tp in tps):
        return [None] * n
    return [cores[k * len(cores) // n:(k + 1) * len(cores) // n] for k in range(n)]


def engine_roles(a: argparse.Namespace) -> list[tuple[str, int]]:
    if a.mix:
        return [("MIX", i) for i in range(a.mix)]
    return [("PREFILL", i) for i in range(a.prefill)] + [("DECODE", i) for i in range(a.decode)]


def engine_flags(a: argparse.Namespace, role: str, security: list[str] = (),
                 kv_store: str | None = None) -> list[str]:
    """The flags an engine of `role` gets beyond its role, model, address and etcd."""
    tp = engine_tp(a, role)
    own = {"MIX": [], "PREFILL": a.prefill_arg, "DECODE": a.decode_arg}[role]
    return ["--kv-cache-transfer-mode", a.kv_cache_transfer_mode,
            "--kv-transfer-backend", a.kv_transfer_backend, *security,
            *(["--kv-store", kv_store] if kv_store else []),
            *(["--tensor-parallel-size", str(tp)] if tp > 1 else []), *a.engine_arg, *own]


def service_argv(a: argparse.Namespace, etcd: str, rpc_port: int,
                 security: list[str] = ()) -> list[str]:
    return ["--etcd", etcd, "--host", a.host, "--http-port", str(a.http_port),
            "--rpc-port", str(rpc_port), "--model", a.model, *security, *a.service_arg]


def tp_error(args: argparse.Namespace) -> str | None:
    """Why the requested TP sizes cannot run (checked before anything starts)."""
    if min(args.prefill_tp, args.decode_tp, args.mix_tp) < 1:
        return "tensor-parallel sizes must be >= 1"
    return None  # (different prefill / decode TP: KV head slices, over ucx or tcp)


class _FlagsError(Exception):
    pass


def _flags_error(parser: argparse.ArgumentParser, to_config, argv: list[str]) -> str | None:
    """What the child's own parser (and config check) says about `argv`, or None."""
    def error(message: str):
        raise _FlagsError(message)

    parser.error = error  # type: ignore[method-assign]
    try:
        to_config(parser.parse_args(argv))
    except (_FlagsError, ValueError) as exc:
        return str(exc)
    except SystemExit:  # --help or --version among the extra flags
        return "--help is not an engine or service flag here"
    return None


def child_flags_error(a: argparse.Namespace) -> str | None:
    """Run each child's command line through its real parser before starting it."""
    from xllm_py.engine.cli import build_parser as engine_parser
    from xllm_py.engine.cli import config_from_args as engine_config
    from xllm_service.cli import build_parser as service_parser
    from xllm_service.cli import config_from_args as service_config

    where = {"MIX": "--engine-arg", "PREFILL": "--engine-arg / --prefill-arg",
             "DECODE": "--engine-arg / --decode-arg"}
    for role in dict(engine_roles(a)):
        argv = engine_args(role, 0, etcd="127.0.0.1:2379", model=a.model, host=a.host,
                           extra=engine_flags(a, role))
        error = _flags_error(engine_parser(), engine_config, argv)
        if error:
            return (f"{role} engine flags ({where[role]}): {error} "
                    f"(see python -m xllm_py.engine --help)")
    error = _flags_error(service_parser(), service_config, service_argv(a, "127.0.0.1:2379", 0))
    if error:
        return f"service flags (--service-arg): {error} (see python -m xllm_service --help)"
    return None


def etcd_members_error(endpoints: str) -> str | None:
    """None when one member of --etcd answers (it reaches the others); else why the
    first does not."""
    from xllm_py.utils.preflight import reachable_error

    errors = [reachable_error(member, "--etcd", "etcd",
                              hint="start it, or leave --etcd out to start one")
              for member in endpoints.split(",")]
    return None if any(e is None for e in errors) else errors[0]


def preflight(a: argparse.Namespace) -> str | None:
    """The first reason the cluster cannot start, found before anything starts."""
    from xllm_py.utils.preflight import model_error, port_error

    if a.mix < 0 or (not a.mix and min(a.prefill, a.decode) < 1):
        return "a PD cluster needs --prefill >= 1 and --decode >= 1 (or --mix K: K MIX engines)"
    checks = (
        lambda: tp_error(a),
        lambda: model_error(a.model),
        lambda: port_error(a.host, a.http_port, "--http-port"),
        lambda: port_error(a.host, a.rpc_port, "--rpc-port"),
        lambda: a.etcd and etcd_members_error(a.etcd),
        lambda: log_dir_error(a.log_dir),
        lambda: child_flags_error(a),
    )
    for check in checks:
        error = check()
        if error:
            return error
    return None


def log_dir_error(log_dir: str | None) -> str | None:
    if log_dir is None:
        return None
    try:
        pathlib.Path(log_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot use --log-dir {log_dir}: {exc.strerror or exc}"
    if not os.access(log_dir, os.W_OK):
        return f"cannot write to --log-dir {log_dir}"
    return None


_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ [\w.]+: ")


def start_failure(cluster: Cluster, exc: BaseException) -> str:
    """One line for a start-up that failed after the children started."""
    dead = cluster.failed_child()
    if dead is not None:
        lines = [ln for ln in dead.log_tail(20).splitlines() if ln.strip()]
        last = _LOG_PREFIX.sub("", lines[-1].strip()) if lines else "(no output)"
        last = last.removeprefix("error: ")
        return (f"{dead.name} exited with {dead.popen.returncode} while starting: {last} "
                f"(its log: {dead.log_path})")
    return f"{str(exc).splitlines()[0]} (logs: {cluster.log_dir})"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    error = preflight(args)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # Flags, not a threading.Event: Event.set() in a signal handler deadlocks when the
    # signal lands while the main thread's Event.wait() holds the Event's lock.
    stopping = [False]
    starting = [True]

    def on_signal(*_: object) -> None:
        stopping[0] = True
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
              f"  KV store:        {cluster.kv_store or 'off (local KV tiers only)'}\n"
              + (f"  certificates:    {cluster.log_dir / 'certs'}\n" if args.tls else "") + "\n"
              f"Try:\n  curl {cluster.url}/v1/completions{auth} -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{model}\", \"prompt\": \"The capital of France is\", "
              f"\"max_tokens\": 24, \"temperature\": 0}}'\n\nCtrl-C stops everything.", flush=True)
        while not stopping[0]:
            time.sleep(0.5)
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
        print(f"error: {start_failure(cluster, exc)}", file=sys.stderr, flush=True)
        return 1
    finally:
        starting[0] = False
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the shutdown finish
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.stop()
        logger.info("stopped; logs in %s", cluster.log_dir)


if __name__ == "__main__":
    sys.exit(main())
