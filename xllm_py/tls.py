"""Cluster TLS: one certificate identity per process, one CA for the whole cluster.

Every gRPC server of the cluster (the service's XllmRpcService, an engine's DisaggPDService
and WorkerService) asks its callers for a certificate signed by the cluster CA (mutual TLS),
and every channel presents the process's own certificate; etcd is reached the same way. A
caller without a cluster certificate fails the TLS handshake before any RPC runs, so the
internal services answer only cluster members.

`TLSConfig.load()` reads the PEM files once; `server_credentials()` / `channel_credentials()`
build the grpc credentials from them. `None` everywhere means plaintext (the default).
"""
from __future__ import annotations

import dataclasses
import ssl
from pathlib import Path

import grpc


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """Paths of the process's certificate and key and of the cluster CA (PEM)."""

    cert: str
    key: str
    ca: str

    @classmethod
    def from_args(cls, cert: str | None, key: str | None, ca: str | None) -> "TLSConfig | None":
        """None when no flag is given; all three or a ValueError naming the missing ones."""
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        if not any(given.values()):
            return None
        missing = [flag for flag, value in given.items() if not value]
        if missing:
            raise ValueError(f"TLS needs --tls-cert, --tls-key and --tls-ca; missing {', '.join(missing)}")
        for flag, value in given.items():
            if not Path(value).is_file():
                raise ValueError(f"{flag}: no such file: {value}")
        return cls(cert=str(cert), key=str(key), ca=str(ca))

    def pem(self) -> tuple[bytes, bytes, bytes]:
        """(cert chain, private key, CA) bytes."""
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), Path(self.ca).read_bytes()


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """Mutual TLS: the server presents its certificate and requires a CA-signed client one."""
    cert, key, ca = tls.pem()
    return grpc.ssl_server_credentials(((key, cert),), root_certificates=ca, require_client_auth=True)


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    """The channel verifies the server against the CA and presents the process's certificate."""
    cert, key, ca = tls.pem()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def client_ssl_context(tls: TLSConfig) -> ssl.SSLContext:
    """An ssl context for plain HTTPS clients of cluster members (etcd's /health)."""
    ctx = ssl.create_default_context(cafile=tls.ca)
    ctx.load_cert_chain(tls.cert, tls.key)
    return ctx
