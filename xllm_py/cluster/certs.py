"""Makes a CA and certificates for a local cluster (what `xllm_py.launch --tls` uses).

    python -m xllm_py.cluster.certs --out certs/ [--host 10.0.0.5 ...] [--name service ...]

writes `ca.pem` (+ `ca-key.pem`) and, for each name (default: etcd, service, engine), `NAME.pem`
and `NAME-key.pem`: an ECDSA P-256 certificate signed by the CA, valid for server and client
authentication, for localhost, 127.0.0.1, ::1 and every `--host`. Keys are written 0600.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_NAMES = ("etcd", "service", "engine")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
_VALID_DAYS = 365


@dataclasses.dataclass(frozen=True)
class Issued:
    """Paths of one issued certificate, its key and the CA that signed it."""

    cert: str
    key: str
    ca: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "xllm-py"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(entries)


def make_ca(out: Path, common_name: str = "xllm-py cluster CA") -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA written to out/ca.pem and out/ca-key.pem."""
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    (out / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(out / "ca-key.pem", key)
    return cert, key


def issue(out: Path, name: str, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
          hosts: list[str]) -> Issued:
    """out/NAME.pem + out/NAME-key.pem, signed by the CA, for server and client auth."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(_name(name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(_san(hosts), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = out / f"{name}.pem", out / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key_path, key)
    return Issued(cert=str(cert_path), key=str(key_path), ca=str(out / "ca.pem"))


def make_cluster_certs(out: str | Path, names: tuple[str, ...] | list[str] = DEFAULT_NAMES,
                       hosts: tuple[str, ...] | list[str] = ()) -> dict[str, Issued]:
    """A fresh CA and one certificate per name; returns name -> Issued."""
    out = Path(out)
    ca_cert, ca_key = make_ca(out)
    all_hosts = [*LOCAL_HOSTS, *hosts]
    return {name: issue(out, name, ca_cert, ca_key, all_hosts) for name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Make a CA and certificates for a local xllm-py cluster.")
    parser.add_argument("--out", required=True, help="directory to write the PEM files to")
    parser.add_argument("--name", action="append", default=None,
                        help=f"a certificate to issue (repeatable; default {', '.join(DEFAULT_NAMES)})")
    parser.add_argument("--host", action="append", default=[],
                        help="an extra DNS name or IP the certificates are valid for (repeatable)")
    args = parser.parse_args(argv)
    issued = make_cluster_certs(args.out, args.name or DEFAULT_NAMES, args.host)
    for name, paths in issued.items():
        print(f"{name}: --tls-cert {paths.cert} --tls-key {paths.key} --tls-ca {paths.ca}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
