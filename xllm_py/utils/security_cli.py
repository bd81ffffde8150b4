"""The security flags shared by the service and the engine: `--api-key` (repeatable),
`--api-key-file`, `--protect-metrics`, `--tls-cert` / `--tls-key` / `--tls-ca`.

etcd is reached with the same TLS files: one cluster CA signs every member's certificate
(etcd's own too), so a process presents one identity to every peer and to etcd.
"""
from __future__ import annotations

import argparse

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
                  "of the cluster serves mutual TLS, every channel and the etcd client present it")
    add_flag(g, "--tls-key", default=None, help="private key of --tls-cert (PEM)")
    add_flag(g, "--tls-ca", default=None,
             help="cluster CA (PEM) that peers' and etcd's certificates must chain to "
                  "(make one: python -m xllm_py.cluster.certs --out DIR)")


def security_from_args(args: argparse.Namespace) -> SecurityConfig:
    """Raises ValueError on an incomplete TLS triple, a missing file or an empty key."""
    from xllm_py.api.auth import collect_api_keys
    from xllm_py.tls import TLSConfig

    return SecurityConfig(api_keys=collect_api_keys(args.api_key, args.api_key_file),
                          protect_metrics=args.protect_metrics,
                          tls=TLSConfig.from_args(args.tls_cert, args.tls_key, args.tls_ca))
