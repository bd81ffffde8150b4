"""The security flags shared by the service and the engine: `--api-key` (repeatable),
`--api-key-file`, `--protect-metrics`, `--tls-cert` / `--tls-key` / `--tls-ca` (the
cluster's gRPC), `--etcd-cacert` / `--etcd-cert` / `--etcd-key` (etcd, etcdctl's spellings).

etcd's TLS is its own: an etcd with a CA of its own, or a plaintext one on a private
network, works beside a mutual-TLS cluster (the same files may be given to both).
"""
from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from xllm_py.config import SecurityConfig
from xllm_py.utils.cli import add_flag, parse_bool


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("security")
    add_flag(g, "--api-key", action="append", default=None,
             help="accepted 'Authorization: Bearer' key of the OpenAI HTTP API (repeatable); "
                  "without one the API is open. /health and /readiness stay open")
    add_flag(g, "--api-key-file", default=None, help="file with accepted API keys, one per line")
    add_flag(g, "--protect-metrics", type=parse_bool, default=False,
             help="/metrics needs an API key too (true/false; default open)")
    add_flag(g, "--tls-cert", default=None,
             help="this process's certificate (PEM, signed by --tls-ca): every gRPC server "
                  "of the cluster serves mutual TLS and every channel presents it (not etcd: "
                  "--etcd-cert)")
    add_flag(g, "--tls-key", default=None, help="private key of --tls-cert (PEM)")
    add_flag(g, "--tls-ca", default=None,
             help="cluster CA (PEM) that peers' certificates must chain to "
                  "(make one: python -m xllm_py.cluster.certs --out DIR)")
    add_flag(g, "--etcd-cacert", default=None,
             help="etcd serves https: the CA (PEM) its certificate must chain to")
    add_flag(g, "--etcd-cert", default=None,
             help="client certificate (PEM) for an etcd with --client-cert-auth")
    add_flag(g, "--etcd-key", default=None, help="private key of --etcd-cert (PEM)")


def security_from_args(args: argparse.Namespace) -> SecurityConfig:
    """Raises ValueError on an incomplete TLS triple, a missing file or an empty key."""
    from xllm_py.tls import EtcdTLSConfig, TLSConfig

    return SecurityConfig(api_keys=collect_api_keys(args.api_key, args.api_key_file),
                          protect_metrics=args.protect_metrics,
                          tls=TLSConfig.from_args(args.tls_cert, args.tls_key, args.tls_ca),
                          etcd_tls=EtcdTLSConfig.from_args(args.etcd_cacert, args.etcd_cert,
                                                           args.etcd_key))


def read_key_file(path: str) -> list[str]:
    """One key per line; blank lines and lines starting with '#' are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"--api-key-file {path}: {exc.strerror or exc}") from None
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


def collect_api_keys(keys: Iterable[str] | None, key_file: str | None) -> tuple[str, ...]:
    """The keys of `--api-key` (repeatable) and `--api-key-file`, de-duplicated, in order.
    Raises ValueError on an empty key or an empty file."""
    found = [k.strip() for k in (keys or ())]
    if any(not k for k in found):
        raise ValueError("--api-key must not be empty")
    if key_file:
        from_file = read_key_file(key_file)
        if not from_file:
            raise ValueError(f"--api-key-file {key_file}: no key in the file")
        found += from_file
    return tuple(dict.fromkeys(found))
