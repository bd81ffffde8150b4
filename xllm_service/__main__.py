"""python -m xllm_service --etcd HOST:PORT ...: run the master.

A mistake in the command line (a missing model, a taken port) is one line on stderr."""
from __future__ import annotations

import errno
import sys

from xllm_py.utils.cli import enable_crash_stacks, run_async, setup_logging
from xllm_service.cli import build_parser, config_from_args


def startup_error(config) -> str | None:
    """Why the service cannot start, from its configuration alone."""
    from xllm_py.utils.preflight import model_error, port_error

    return (model_error(config.model)
            or port_error(config.host, config.http_port, "--http-port")
            or port_error(config.host, config.rpc_port, "--rpc-port"))


def main(argv: list[str] | None = None) -> int:
    enable_crash_stacks()  # a native crash prints every thread's Python stack
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(args.log_level)
    error = startup_error(config)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from xllm_service.server import run_service

    from xllm_py.cluster.etcd_startup import EtcdStartupError

    try:
        run_async(run_service(config))
    except KeyboardInterrupt:
        pass
    except EtcdStartupError as exc:
        print(f"xllm_service: {exc}", file=sys.stderr)
        return 1
    except FileNotFoundError as exc:  # e.g. a model directory without tokenizer.json
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"error: a port was taken while the service started ({exc.strerror}): "
              f"pass free ones (--http-port, --rpc-port)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
