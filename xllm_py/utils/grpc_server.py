"""start_grpc_server: bind, register one servicer, start; the one way every process
(service, engine, KV worker) brings up its gRPC server."""
from __future__ import annotations

from typing import Any, Callable

import grpc


# Accept the clients' keepalive pings (grpc_channels.CHANNEL_OPTIONS); by default a server
# answers pings more frequent than every 5 minutes with GOAWAY (too_many_pings).
SERVER_OPTIONS = (
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
)


async def start_grpc_server(add_servicer: Callable[[Any, grpc.aio.Server], None], servicer: Any,
                            host: str, port: int, what: str,
                            credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.aio.Server, int]:
    """Returns (started server, bound port). Stop it with `await server.stop(grace)`.
    With `credentials` (xllm_py.tls.server_credentials) the port serves mutual TLS only."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_servicer(servicer, server)
    address = f"{host}:{port}"
    bound = (server.add_insecure_port(address) if credentials is None
             else server.add_secure_port(address, credentials))
    if bound == 0:
        raise OSError(f"could not bind {what} on {host}:{port}")
    await server.start()
    return server, bound
