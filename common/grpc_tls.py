"""Mutual TLS for the control plane (docs/design.md §3 "Control-plane security").

With ``--grpc-tls-cert``, ``--grpc-tls-key`` and ``--grpc-tls-ca`` (PEM files; env twins
``PDSERVE_GRPC_TLS_*``) a service listens with TLS and requires every caller to present a
certificate signed by the CA; the router presents its own certificate and verifies the
service's against the same CA. The three come together or not at all: a service without the
CA could not check its callers, a router without a certificate would be refused.

The name the router checks in the service's certificate is the address it dials (an IP or
a DNS name: the certificate must list it as a SAN), or ``--grpc-tls-server-name`` when set,
which is how a router that dials pod IPs (k8s discovery) checks one shared service name.

A caller's identity (``peer_identity``) is what its certificate names: the SANs, or the
subject CN when it has none, as gRPC reports them. Without TLS every caller has the empty
identity: a token only proves membership, not who is calling.

Files are read and checked at startup (``TlsFiles.load``) with the standard ``ssl`` module,
so a missing file, a key that does not match its certificate or a CA file without a
certificate fails with a message that names the flag, not with a handshake error later.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

FLAGS = ("--grpc-tls-cert", "--grpc-tls-key", "--grpc-tls-ca")


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The PEM contents of one side's certificate chain, private key and trusted CA."""

    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def load(cls, cert: str, key: str, ca: str) -> TlsFiles | None:
        """Read and check the three files; None when none is set (TLS off).

        Raises ValueError naming the flag when only some are set, a file is missing or
        unreadable, the key does not match the certificate, or the CA file holds no
        certificate.
        """
        given = dict(zip(FLAGS, (cert, key, ca), strict=True))
        if not any(given.values()):
            return None
        missing = [flag for flag, path in given.items() if not path]
        if missing:
            have = ", ".join(flag for flag, path in given.items() if path)
            raise ValueError(
                f"mTLS needs {', '.join(FLAGS)} together: {have} set but "
                f"{', '.join(missing)} missing"
            )
        data = {flag: _read(flag, path) for flag, path in given.items()}
        _check_pair(cert, key)
        _check_ca(ca)
        return cls(data["--grpc-tls-cert"], data["--grpc-tls-key"], data["--grpc-tls-ca"])

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials of a service: its own chain, and callers must present one the CA signed."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a caller: trust only the CA, present our own chain."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def channel_options(server_name: str) -> list[tuple[str, Any]]:
    """Extra channel options: check ``server_name`` in the service's certificate instead of
    the dialed host (empty: the dialed host)."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


def peer_identity(context: Any) -> str:
    """The authenticated name of a call's peer: its certificate's identities, sorted and
    comma-joined; "" without TLS (every caller alike)."""
    try:
        names = context.peer_identities()
    except (AttributeError, ValueError):  # no auth context (plaintext), or a test double
        return ""
    return ",".join(sorted(_text(n) for n in names or ()))


def identity_allowed(identity: str, allowed: Iterable[str]) -> bool:
    """Whether one of the peer's names (``peer_identity``'s parts) is in ``allowed``."""
    wanted = set(allowed)
    return any(name in wanted for name in identity.split(",") if name)


def parse_allowed(text: str) -> tuple[str, ...]:
    """``--grpc-allowed-clients``: comma-separated certificate names (SAN DNS/IP or CN)."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _text(name: str | bytes) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else name


def _read(flag: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def _check_pair(cert: str, key: str) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ValueError(
            f"--grpc-tls-cert {cert} / --grpc-tls-key {key}: not a certificate and its "
            f"matching private key ({exc.reason or exc})"
        ) from None


def _check_ca(ca: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=ca)
    except ssl.SSLError as exc:
        raise ValueError(
            f"--grpc-tls-ca {ca}: no CA certificate in it ({exc.reason or exc})"
        ) from None
    if not context.get_ca_certs():
        raise ValueError(f"--grpc-tls-ca {ca}: no CA certificate in it")
