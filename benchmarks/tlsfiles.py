"""TLS material for the benchmarks' `--tls` runs: a throwaway CA and a server certificate it
signs for the address the servers listen on, written as PEM files into a temporary directory
(needs `cryptography`, one of the test extras: pip install '.[test]')."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import tempfile
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM files: `ca` signed `cert` (with its `key`) for the servers' address."""

    ca: Path
    cert: Path
    key: Path

    def serve_flags(self) -> list[str]:
        """`remote-loader serve`'s flags for this certificate."""
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key)]


def make(host: str) -> TlsFiles:
    """A CA and a P-256 certificate for `host` (an IP address), in a new temporary directory."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    out = Path(tempfile.mkdtemp(prefix="rlbench-tls-"))

    def issue(
        name: str, key: ec.EllipticCurvePrivateKey, ca: tuple[x509.Name, Any] | None
    ) -> x509.Certificate:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        issuer, signer = ca or (subject, key)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), critical=True)
        )
        if ca is not None:
            san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))])
            builder = builder.add_extension(san, critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = issue("remote-loader benchmark CA", ca_key, None)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = issue(host, key, (ca.subject, ca_key))
    files = TlsFiles(out / "ca.pem", out / "server.pem", out / "server.key")
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return files


def remove(files: TlsFiles) -> None:
    for path in (files.ca, files.cert, files.key):
        path.unlink(missing_ok=True)
    files.ca.parent.rmdir()
