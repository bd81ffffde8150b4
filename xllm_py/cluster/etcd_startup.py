"""The start-up check of a process that needs etcd (the service, an engine with --etcd).

Once running, a process rides out an etcd outage (it retries, keeps serving what it knows).
At start-up that patience hides a mistake: an etcd that is not there, or one spoken to in
the wrong way (TLS to a plaintext etcd, plaintext to a TLS one, a certificate from another
CA), used to give a retry loop without end and an instance that never registered.
`check_etcd` does one real round trip, retrying an unreachable etcd for a few seconds (it
may be starting beside us) and a TLS or authentication failure not at all, and raises
`EtcdStartupError` with one line that says what to check.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time

from xllm_py.cluster.etcd_client import EtcdClient, EtcdError

logger = logging.getLogger(__name__)

# An etcd started beside us (launcher, compose) answers within this; past it, it is not there.
STARTUP_WAIT_S = 10.0

_TLS_MARKERS = ("handshake", "ssl", "certificate", "tls", "wrong version number")
_AUTH_MARKERS = ("authentication", "auth token", "user name", "permission denied",
                 "invalid password", "unauthenticated")


class EtcdStartupError(RuntimeError):
    """etcd could not be reached or spoken to at start-up: the message is the one line."""


def describe(endpoint: str, tls: bool, error: str) -> str:
    """One line: what failed and which flags to look at."""
    low = error.lower()
    if any(m in low for m in _TLS_MARKERS):
        hint = ("the TLS handshake failed: "
                + ("does etcd serve https, and does --etcd-cacert sign its certificate "
                   "(--etcd-cert/--etcd-key if it asks for a client certificate)?" if tls else
                   "etcd serves https: give --etcd-cacert (and --etcd-cert/--etcd-key if it "
                   "asks for a client certificate)"))
    elif any(m in low for m in _AUTH_MARKERS):
        hint = "etcd refused the credentials (ETCD_USERNAME / ETCD_PASSWORD)"
    elif not tls and ("socket closed" in low or "connection reset" in low):
        hint = ("etcd closed the connection: does it serve https? give --etcd-cacert "
                "(and --etcd-cert/--etcd-key)")
    else:
        hint = f"is etcd running at {endpoint} and reachable from here?"
    return f"cannot use etcd at {endpoint}: {hint} ({error})"


def _permanent(error: str) -> bool:
    """A TLS or credentials mismatch, or an etcd that took the connection and closed it
    (plaintext to https): waiting does not mend it."""
    low = error.lower()
    return any(m in low for m in (*_TLS_MARKERS, *_AUTH_MARKERS, "socket closed"))


async def check_etcd(client: EtcdClient, tls: bool, wait_s: float = STARTUP_WAIT_S) -> None:
    """One round trip through `client` (connected or not); EtcdStartupError when none
    succeeds within `wait_s` (at once for a TLS or authentication failure)."""
    deadline = time.monotonic() + wait_s
    delay = 0.1
    while True:
        try:
            await client.connect()
            await client.store_identity()
            return
        except EtcdError as e:
            # (the error names the member that answered last: with several, any of them)
            error = re.sub(r"^etcd \S+: ", "", str(e))
            endpoints = ",".join(client.endpoints)
            if _permanent(error) or time.monotonic() + delay > deadline:
                raise EtcdStartupError(describe(endpoints, tls, error)) from None
            logger.info("etcd %s not answering yet (%s); retrying", endpoints, error)
        await asyncio.sleep(delay)
        delay = min(1.0, delay * 2)


async def check_etcd_endpoint(endpoint: str, namespace: str = "",
                              tls: "object | None" = None,
                              wait_s: float = STARTUP_WAIT_S) -> None:
    """check_etcd on a client of its own (closed after): an engine checks before it spends
    its start-up loading weights. `tls`: an EtcdTLSConfig or None."""
    client = EtcdClient(endpoint, namespace=namespace, tls=tls)
    try:
        await check_etcd(client, tls is not None, wait_s)
    finally:
        await client.close()
