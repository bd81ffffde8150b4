"""Running an app under uvicorn: `serve` for the processes, `serve_in_thread` for tests and
embedding (own event loop in a daemon thread). Access logs are off by default."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)


def _config(app: FastAPI, host: str, port: int, access_log: bool) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, access_log=access_log, log_config=None,
        timeout_graceful_shutdown=5,
    )


def _bound_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class _SignalFreeServer(uvicorn.Server):
    """Leaves SIGINT/SIGTERM to the caller's handlers."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(
    app: FastAPI, host: str, port: int, *, access_log: bool = False,
    stop_event: asyncio.Event | None = None, capture_signals: bool = True,
) -> None:
    """Serve until `stop_event` is set (graceful shutdown) or SIGINT/SIGTERM.

    In the main thread uvicorn captures SIGINT/SIGTERM while serving, shuts down gracefully
    and then re-raises the signal to the handlers that were installed before (e.g. the
    caller's `loop.add_signal_handler`). `capture_signals=False` leaves the signals to
    those handlers alone (serving goes on until `stop_event`: an engine that drains).
    """
    cls = uvicorn.Server if capture_signals else _SignalFreeServer
    sock = _bound_socket(host, port)  # (a taken port: OSError here, not uvicorn's exit 3)
    server = cls(_config(app, host, sock.getsockname()[1], access_log))
    watcher: asyncio.Task | None = None
    if stop_event is not None:

        async def _watch() -> None:
            await stop_event.wait()
            server.should_exit = True

        watcher = asyncio.ensure_future(_watch())
    logger.info("HTTP server listening on %s:%d", host, sock.getsockname()[1])
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()
        if watcher is not None:
            watcher.cancel()


class ServerHandle:
    """A uvicorn server running in a daemon thread with its own event loop."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, host: str, port: int):
        self._server = server
        self._thread = thread
        self.host = host
        self.port = port

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("HTTP server thread did not stop within %.1f s", timeout)


def serve_in_thread(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, *, access_log: bool = False,
    startup_timeout: float = 10.0,
) -> ServerHandle:
    """Start serving in a daemon thread; port 0 picks a free port (see `handle.port`)."""
    sock = _bound_socket(host, port)
    bound_port = sock.getsockname()[1]
    server = uvicorn.Server(_config(app, host, bound_port, access_log))

    def run() -> None:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        finally:
            sock.close()

    thread = threading.Thread(target=run, name=f"http-{host}:{bound_port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"HTTP server on {host}:{bound_port} failed to start")
        time.sleep(0.01)
    return ServerHandle(server, thread, host, bound_port)
