"""Run-time test certificates (``cryptography``): a CA, server and client pairs, and a rogue CA.

Shared by the TLS tests of the shard (``test_security.py``) and of the ring
(``test_collective_security.py``); no key is ever committed. Import it after
``pytest.importorskip("cryptography")``.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pki:
    """PEM files: ``ca`` signed the server and client pairs, ``rogue_ca`` the rogue client pair.

    The server certificate is valid for ``localhost`` and ``127.0.0.1``.
    """

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_client_cert: Path
    rogue_client_key: Path

    def shard_flags(self, *, mutual: bool = True) -> list[str]:
        """``psserver`` flags: TLS with the server pair (``mutual``: clients need a pair ``ca`` signed)."""
        flags = ["--tls-cert", str(self.server_cert), "--tls-key", str(self.server_key)]
        return [*flags, "--tls-client-ca", str(self.ca)] if mutual else flags

    def client_options(self) -> dict[str, str]:
        """``PSClient`` / ``AsyncPSClient`` TLS options: trust ``ca``, present the client pair."""
        return {"tls_ca": str(self.ca), "tls_cert": str(self.client_cert), "tls_key": str(self.client_key)}


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer or (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, *objs: object) -> Path:
    data = b""
    for obj in objs:
        if isinstance(obj, x509.Certificate):
            data += obj.public_bytes(serialization.Encoding.PEM)
        else:
            data += obj.private_bytes(  # type: ignore[attr-defined]
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
    path.write_bytes(data)
    return path


def make_pki(directory: Path) -> Pki:
    """Generates a fresh set of keys and certificates as PEM files in ``directory``."""
    ca_key, rogue_key = _key(), _key()
    ca = _cert("test-ca", ca_key, None, ca=True)
    rogue = _cert("rogue-ca", rogue_key, None, ca=True)
    s_key, c_key, r_key = _key(), _key(), _key()
    d = directory
    return Pki(
        ca=_write(d / "ca.pem", ca),
        server_cert=_write(d / "server.pem", _cert("psserver", s_key, ("test-ca", ca_key), server=True)),
        server_key=_write(d / "server.key", s_key),
        client_cert=_write(d / "client.pem", _cert("worker", c_key, ("test-ca", ca_key))),
        client_key=_write(d / "client.key", c_key),
        rogue_ca=_write(d / "rogue-ca.pem", rogue),
        rogue_client_cert=_write(d / "rogue.pem", _cert("intruder", r_key, ("rogue-ca", rogue_key))),
        rogue_client_key=_write(d / "rogue.key", r_key),
    )
