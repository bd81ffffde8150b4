"""python -m xllm_service --etcd HOST:PORT ...: run the master."""
from __future__ import annotations

import sys

from xllm_py.utils.cli import run_async, setup_logging
from xllm_service.cli import build_parser, config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(args.log_level)
    from xllm_service.server import run_service

    from xllm_py.cluster.etcd_startup import EtcdStartupError

    try:
        run_async(run_service(config))
    except KeyboardInterrupt:
        pass
    except EtcdStartupError as exc:
        print(f"xllm_service: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
