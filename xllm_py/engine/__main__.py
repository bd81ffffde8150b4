"""python -m xllm_py.engine: run one engine instance (MIX, PREFILL or DECODE)."""
from __future__ import annotations

import sys

from xllm_py.engine.cli import build_parser, config_from_args
from xllm_py.utils.cli import run_async, setup_logging


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from xllm_py.engine.server import run_engine_server

    from xllm_py.cluster.etcd_startup import EtcdStartupError

    try:
        run_async(run_engine_server(config))
    except KeyboardInterrupt:
        pass
    except EtcdStartupError as exc:
        print(f"xllm_py.engine: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
