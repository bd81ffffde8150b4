"""argparse helpers: every flag is accepted in both spellings (--block-size and --block_size),
as xLLM's gflags use underscores."""
from __future__ import annotations

import argparse
import copy
import io
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


def parse_etcd_endpoints(text: str) -> list[str]:
    """`host:port[,host:port...]` (members of one etcd cluster; an `http://`/`https://`
    prefix allowed) -> the members as bare `host:port` (TLS is its own setting, and the
    launcher's reachability check and the store's etcd:// URL take host:port); ValueError
    with one line naming the bad item."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ValueError(f"etcd endpoints must be host:port[,host:port...], got {text!r}")
    members = []
    for item in items:
        member = item.removeprefix("http://").removeprefix("https://")
        host, sep, port = member.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint must be host:port, got {item!r} in {text!r}")
        members.append(member)
    return members


def etcd_endpoints(text: str) -> str:
    """argparse type of --etcd: the members, checked, joined by commas."""
    try:
        return ",".join(parse_etcd_endpoints(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except where there is none to show (None, an
    off switch, an empty list) or its help already says it."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        # --http-port, not "--http-port HTTP_PORT, --http_port HTTP_PORT" (the description
        # says that underscores work)
        shown = [o for o in action.option_strings if "_" not in o] or action.option_strings
        if shown != action.option_strings:
            action = copy.copy(action)
            action.option_strings = shown
        return super()._format_action_invocation(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or default == [] or action.help is None:
            return action.help
        return super()._get_help_string(action)


# Libraries that log every request at INFO (httpx: each readiness poll of the launcher).
_CHATTY_LOGGERS = ("httpx", "httpcore")


def setup_logging(level: str = "INFO") -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=lvl, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if lvl > logging.DEBUG:
        for name in _CHATTY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def run_async(main_coro) -> None:
    """asyncio.run on uvloop when it is installed (faster HTTP and RPC hops)."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coro)
        return
    uvloop.run(main_coro)


def enable_crash_stacks() -> None:
    """A native crash (SIGSEGV, SIGABRT, ...) prints every thread's Python stack to stderr,
    so the process's log says where it was. Where stderr is no file (a caller capturing it
    in memory) there is nowhere to print them: nothing is enabled."""
    import faulthandler

    try:
        faulthandler.enable(all_threads=True)
    except (io.UnsupportedOperation, ValueError, AttributeError):
        pass
