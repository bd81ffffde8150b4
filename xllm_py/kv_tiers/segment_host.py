"""python -m xllm_py.kv_tiers.segment_host: memory for a Mooncake Store, in a process of its
own.

A Mooncake Store keeps its values in segments of memory its clients contribute. Engines
come and go (and a dead client's segment takes its blocks with it), so a cluster's store
memory lives here: a client that contributes `--size-mb` and does nothing else. It
outlives a restart of the store's master (the client reconnects and mounts its segment
again by itself); SIGTERM or SIGINT ends it.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

from xllm_py.kv_tiers.store import load_client_class
from xllm_py.utils.cli import add_flag, setup_logging

logger = logging.getLogger(__name__)
READY = "segment host ready"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xllm_py.kv_tiers.segment_host",
                                description=__doc__.splitlines()[0])
    add_flag(p, "--master", required=True, help="the store's master HOST:PORT")
    add_flag(p, "--metadata", required=True,
             help="the store's metadata service: etcd://HOST:PORT or http://HOST:PORT/metadata")
    add_flag(p, "--size-mb", type=int, default=1024, help="memory this host gives the store")
    add_flag(p, "--host", default="127.0.0.1", help="address the store's clients reach it at")
    add_flag(p, "--log-level", default="INFO")
    a = p.parse_args(argv)
    setup_logging(a.log_level)
    if a.size_mb <= 0:
        p.error("--size-mb must be positive")
    cls, why = load_client_class()
    if cls is None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    client = cls()
    rc = client.setup(a.host, a.metadata, a.size_mb << 20, 16 << 20, "tcp", "", a.master)
    if rc != 0:
        print(f"error: the store at {a.master} refused the segment (setup returned {rc}); is "
              "its master running?", file=sys.stderr)
        return 1
    logger.info("%s: %d MB for the store at %s", READY, a.size_mb, a.master)
    # A flag, not a threading.Event: Event.set() in a signal handler deadlocks when the
    # signal lands while the main thread's Event.wait() holds the Event's lock.
    stopping = [False]
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.__setitem__(0, True))
    while not stopping[0]:
        time.sleep(0.2)
    # Unmount the segment if the master answers soon; a master that is gone would hold
    # the call for seconds, and exiting frees the memory anyway.
    closer = threading.Thread(target=_close, args=(client,), daemon=True)
    closer.start()
    closer.join(timeout=3)
    # (os._exit: the client's destructor would try the master again, as long as it takes)
    logging.shutdown()
    os._exit(0)


def _close(client) -> None:
    try:
        client.close()
    except Exception:
        logger.debug("closing the store client failed", exc_info=True)


if __name__ == "__main__":
    sys.exit(main())
