"""argparse helpers: every flag is accepted in both spellings (--block-size and --block_size),
as xLLM's gflags use underscores."""
from __future__ import annotations

import argparse
import logging


def add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str,
             *aliases: str, **kwargs) -> None:
    """add_flag(p, "--block-size", type=int) accepts --block-size and --block_size."""
    names = [name, *aliases]
    for n in list(names):
        alt = "--" + n[2:].replace("-", "_") if "-" in n[2:] else None
        if alt and alt not in names:
            names.append(alt)
    kwargs.setdefault("dest", name[2:].replace("-", "_"))
    parser.add_argument(*names, **kwargs)


def parse_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {value!r}")


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_async(main_coro) -> None:
    """asyncio.run on uvloop when it is installed (faster HTTP and RPC hops)."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coro)
        return
    uvloop.run(main_coro)
