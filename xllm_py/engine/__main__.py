"""python -m xllm_py.engine: run one engine instance (MIX, PREFILL or DECODE).

A mistake in the command line (a missing model, a taken port, a PD role without a
cluster) is one line on stderr, found before the model loads where it can be."""
from __future__ import annotations

import errno
import sys

from xllm_py.config import EngineConfig, InstanceRole
from xllm_py.engine.cli import build_parser, config_from_args
from xllm_py.utils.cli import enable_crash_stacks, run_async, setup_logging


def startup_error(config: EngineConfig) -> str | None:
    """Why this engine cannot start, from its configuration alone."""
    from xllm_py.utils.preflight import model_error, port_error

    if config.role in (InstanceRole.PREFILL, InstanceRole.DECODE) and not config.etcd_addr:
        role = config.role.value
        return (f"--instance-role {role} needs --etcd HOST:PORT: a {role.lower()} instance "
                "serves only as half of a pair that xllm_service routes (python -m "
                "xllm_py.launch starts the whole cluster); to serve on its own, use "
                "--instance-role MIX")
    error = model_error(config.model)
    if error:
        return error
    for port, flag in ((config.port, "--port"), (config.disagg_pd_port, "--disagg-pd-port"),
                       (config.worker_port, "--worker-port"),
                       (config.transfer.listen_port, "--transfer-listen-port")):
        error = port_error(config.host, port, flag)
        if error:
            return error
    return None


def main(argv: list[str] | None = None) -> int:
    enable_crash_stacks()  # a native crash prints every thread's Python stack
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    error = startup_error(config)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from xllm_py.utils.omp_env import set_omp_env

    set_omp_env()  # (before the server module loads torch)
    from xllm_py.engine.server import run_engine_server

    from xllm_py.cluster.etcd_startup import EtcdStartupError

    options = {}
    if config.simulate:  # a time model in place of the model (no torch): the simulator's engine
        from xllm_py.sim.engine import SimulatedEngine

        options["make_engine"] = SimulatedEngine
    try:
        run_async(run_engine_server(config, **options))
    except KeyboardInterrupt:
        pass
    except EtcdStartupError as exc:
        print(f"xllm_py.engine: {exc}", file=sys.stderr)
        return 1
    except FileNotFoundError as exc:  # model files the checks above cannot see
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"error: a port was taken while the engine started ({exc.strerror}): "
              f"pass free ones (--port, --disagg-pd-port, ...)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
