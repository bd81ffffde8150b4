"""`python -m xllm_py.sim.host --count N --name-prefix P [engine flags]`: N simulated
engines in one process, each its own instance (name P-i, its own HTTP, DisaggPDService,
worker and transfer ports, its own etcd lease and heartbeats). One process per engine
costs ~60 MB and a Python start each; a fleet of 128 on a small machine needs fewer.

Stages: parse the engine flags once (and --simulate PROFILE, required) -> per instance: a config
with its name and a free HTTP port -> run every `run_engine_server` on one loop, sharing
one stop event -> SIGTERM drains them all (a second signal ends the drains), then exit.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys

from xllm_py.engine.cli import build_parser, config_from_args
from xllm_py.utils.cli import enable_crash_stacks, run_async, setup_logging
from xllm_py.utils.procs import free_port


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list]:
    p = argparse.ArgumentParser(prog="python -m xllm_py.sim.host",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, required=True, help="simulated engines to run")
    p.add_argument("--name-prefix", required=True, help="instance i registers as PREFIX-i")
    p.add_argument("--first-index", type=int, default=0, help="i of the first instance")
    p.add_argument("--simulate", required=True, metavar="PROFILE",
                   help="the engines' time model (JSON from python -m xllm_py.sim.profile)")
    p.add_argument("--ports", default=None,
                   help="comma-separated HTTP ports, one per instance (default: free ports "
                        "picked here; a launcher of several hosts should pick them, so that "
                        "two hosts never pick the same)")
    args, rest = p.parse_known_args(argv)
    if args.count < 1:
        p.error("--count must be >= 1")
    ports = [int(x) for x in args.ports.split(",")] if args.ports else None
    if ports is not None and len(ports) != args.count:
        p.error(f"--ports lists {len(ports)} ports for --count {args.count}")
    engine_args = build_parser().parse_args(rest)
    engine_args.simulate = args.simulate  # (the engine's settings-file key simulate)
    base = config_from_args(engine_args)
    ports = ports or [free_port(base.host) for _ in range(args.count)]
    configs = [dataclasses.replace(base, instance_name=f"{args.name_prefix}-{args.first_index + k}",
                                   port=port) for k, port in enumerate(ports)]
    return engine_args, configs


async def run_host(configs: list) -> None:
    from xllm_py.engine.server import install_signal_handlers, run_engine_server
    from xllm_py.sim.engine import SimulatedEngine

    stop, force = asyncio.Event(), asyncio.Event()
    install_signal_handlers(stop, force)
    await asyncio.gather(*(run_engine_server(c, stop, force, SimulatedEngine) for c in configs))


def main(argv: list[str] | None = None) -> int:
    enable_crash_stacks()  # a native crash prints every thread's Python stack
    engine_args, configs = parse(argv)
    setup_logging(engine_args.log_level)
    try:
        run_async(run_host(configs))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
