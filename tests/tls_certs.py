"""Test PKI for the control plane's mTLS: a CA, a service certificate for 127.0.0.1 and
localhost, client certificates with distinct names, and a second, untrusted CA.

Made with the ``cryptography`` package (the dev extra) into a directory; each ``Pair``
names its PEM files as the ``--grpc-tls-*`` flags want them.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.grpc_tls import TlsFiles


@dataclass(frozen=True, slots=True)
class Pair:
    """A certificate and key on disk, with the CA file that verifies the other side."""

    cert: Path
    key: Path
    ca: Path

    def env(self) -> dict[str, str]:
        """``PDSERVE_GRPC_TLS_*`` for a child process."""
        return {
            "PDSERVE_GRPC_TLS_CERT": str(self.cert),
            "PDSERVE_GRPC_TLS_KEY": str(self.key),
            "PDSERVE_GRPC_TLS_CA": str(self.ca),
        }

    def files(self) -> TlsFiles:
        loaded = TlsFiles.load(str(self.cert), str(self.key), str(self.ca))
        assert loaded is not None
        return loaded


class Authority:
    """A CA that writes certificates it signs into ``root``."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            _builder(subject, subject, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.ca_path = root / f"{name}-ca.crt"
        self.ca_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self, name: str, *, dns: tuple[str, ...] = (), ips: tuple[str, ...] = (), trust: Path
    ) -> Pair:
        """A leaf for TLS server and client use named ``name`` (CN) with these SANs;
        ``trust`` is the CA file its holder verifies peers with."""
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = _builder(subject, self.cert.subject, key.public_key())
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        ).sign(self.key, hashes.SHA256())
        cert_path, key_path = self.root / f"{name}.crt", self.root / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        key_path.chmod(0o600)
        return Pair(cert_path, key_path, trust)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: object) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


@dataclass(frozen=True, slots=True)
class Pki:
    """``service``: the engines' certificate (127.0.0.1, localhost); ``router`` and
    ``operator``: clients the services allow; ``stranger``: signed by the CA but not
    allowed; ``rogue``: the router's name, signed by another CA."""

    service: Pair
    router: Pair
    operator: Pair
    stranger: Pair
    rogue: Pair
    ca: Path


def make_pki(root: Path) -> Pki:
    ca = Authority(root, "pdserve-test")
    other = Authority(root / "other", "rogue")
    trust = ca.ca_path
    return Pki(
        service=ca.issue("engine", dns=("localhost",), ips=("127.0.0.1",), trust=trust),
        router=ca.issue("router", dns=("router.pdserve.test",), trust=trust),
        operator=ca.issue("operator", dns=("operator.pdserve.test",), trust=trust),
        stranger=ca.issue("stranger", dns=("stranger.pdserve.test",), trust=trust),
        rogue=other.issue("router", dns=("router.pdserve.test",), trust=trust),
        ca=trust,
    )
