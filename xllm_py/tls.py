"""Cluster TLS: one certificate identity per process, one CA for the whole cluster.

Every gRPC server of the cluster (the service's XllmRpcService, an engine's DisaggPDService
and WorkerService) asks its callers for a certificate signed by the cluster CA (mutual TLS),
and every channel presents the process's own certificate. A caller without a cluster
certificate fails the TLS handshake before any RPC runs, so the internal services answer
only cluster members.

etcd is a separate server with its own TLS set-up (often its own CA, or plaintext on a
private network): `EtcdTLSConfig` (etcdctl's `--cacert` / `--cert` / `--key`, spelled
`--etcd-cacert` / `--etcd-cert` / `--etcd-key` here) says how to reach it, independent of
the cluster's gRPC TLS.

`server_credentials()` / `channel_credentials()` build the grpc credentials from the PEM
files. `None` everywhere means plaintext (the default).
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


@dataclasses.dataclass(frozen=True)
class EtcdTLSConfig:
    """How to reach an etcd that serves https: `cacert` verifies etcd's certificate (None:
    the system's roots); `cert` + `key`, when given, are the client identity etcd's
    --client-cert-auth asks for."""

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None

    @classmethod
    def from_args(cls, cacert: str | None, cert: str | None,
                  key: str | None) -> "EtcdTLSConfig | None":
        """None when no flag is given (plaintext etcd); a ValueError for a certificate
        without its key (or the reverse) or a missing file."""
        given = {"--etcd-cacert": cacert, "--etcd-cert": cert, "--etcd-key": key}
        if not any(given.values()):
            return None
        if bool(cert) != bool(key):
            raise ValueError("etcd client TLS needs --etcd-cert and --etcd-key together; missing "
                             + ("--etcd-key" if cert else "--etcd-cert"))
        for flag, value in given.items():
            if value and not Path(value).is_file():
                raise ValueError(f"{flag}: no such file: {value}")
        return cls(cacert=cacert or None, cert=cert or None, key=key or None)

    @classmethod
    def of(cls, tls: "TLSConfig") -> "EtcdTLSConfig":
        """etcd reached with a cluster identity (one CA signs etcd's certificate too)."""
        return cls(cacert=tls.ca, cert=tls.cert, key=tls.key)

    def flags(self) -> list[str]:
        """The command-line flags that give a child process this configuration."""
        out: list[str] = []
        for flag, value in (("--etcd-cacert", self.cacert), ("--etcd-cert", self.cert),
                            ("--etcd-key", self.key)):
            if value:
                out += [flag, value]
        return out


def etcd_channel_credentials(tls: "EtcdTLSConfig | TLSConfig") -> grpc.ChannelCredentials:
    """Credentials of a channel to etcd (a TLSConfig: its cluster identity)."""
    if isinstance(tls, TLSConfig):
        tls = EtcdTLSConfig.of(tls)
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    return grpc.ssl_channel_credentials(root_certificates=read(tls.cacert),
                                        private_key=read(tls.key),
                                        certificate_chain=read(tls.cert))


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
