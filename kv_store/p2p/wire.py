"""Control messages of the p2p connector: length-prefixed JSON over plain TCP.

Every message is a 4-byte big-endian length and that many bytes of UTF-8 JSON (an object).
Every read and write takes an absolute ``time.monotonic()`` deadline; running past it, a
closed connection or a malformed frame raises ``PeerError`` — nothing here blocks forever.
Only the standard library is used, so the module imports on a machine that has only torch.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

# Control messages are small (a pull names at most a few thousand block hashes); a larger
# length means a stray client or a corrupt stream, refused before allocating anything.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
_LEN = struct.Struct("!I")


class PeerError(RuntimeError):
    """The peer, or the connection to it, failed. ``reason`` goes into the transfer result:
    ``"unreachable"`` (connect, reset, closed), ``"timeout"`` (a deadline passed),
    ``"protocol"`` (an unexpected message), or what the peer reported (``"missing"``, ...)."""

    def __init__(self, message: str, reason: str = "unreachable") -> None:
        super().__init__(message)
        self.reason = reason


def remaining(deadline: float) -> float:
    """Seconds left before ``deadline``; ``PeerError("timeout")`` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerError("p2p deadline exceeded", "timeout")
    return left


def send_msg(sock: socket.socket, msg: dict[str, Any], deadline: float) -> None:
    """Write one message, all of it, before ``deadline``."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise PeerError(f"control message of {len(body)} bytes is too large", "protocol")
    try:
        sock.settimeout(remaining(deadline))
        sock.sendall(_LEN.pack(len(body)) + body)
    except TimeoutError:
        raise PeerError("p2p control send timed out", "timeout") from None
    except OSError as e:
        raise PeerError(f"p2p control send failed: {e}") from None


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            sock.settimeout(None if deadline is None else remaining(deadline))
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            raise PeerError("p2p control receive timed out", "timeout") from None
        except OSError as e:
            raise PeerError(f"p2p control receive failed: {e}") from None
        if k == 0:
            raise PeerError("p2p peer closed the connection")
        got += k
    return bytes(buf)


def recv_msg(
    sock: socket.socket, deadline: float | None, limit: int = MAX_MESSAGE_BYTES
) -> dict[str, Any]:
    """Read one message of at most ``limit`` bytes. ``deadline=None`` waits indefinitely:
    only for an idle server connection waiting for the next request, which closing the
    socket interrupts."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if n > limit:
        raise PeerError(f"control message of {n} bytes announced; refusing", "protocol")
    try:
        msg = json.loads(_recv_exact(sock, n, deadline))
    except ValueError as e:
        raise PeerError(f"malformed control message: {e}", "protocol") from None
    if not isinstance(msg, dict):
        raise PeerError("control message is not a JSON object", "protocol")
    return msg


def expect(msg: dict[str, Any], op: str) -> dict[str, Any]:
    """``msg`` if it is an ``op`` message that says ok; else ``PeerError`` with the peer's
    reason (a refusal) or ``"protocol"`` (the wrong message)."""
    if msg.get("op") != op:
        raise PeerError(f"expected a {op!r} message, got {msg.get('op')!r}", "protocol")
    if not msg.get("ok", False):
        raise PeerError(str(msg.get("error", "refused")), str(msg.get("reason", "refused")))
    return msg


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` → ``(host, port)``; ``ValueError`` otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"p2p address must look like host:port, got {address!r}")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    """``(host, port)`` → ``"host:port"`` (IPv6 hosts in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connect(address: str, deadline: float) -> socket.socket:
    """A connected TCP socket to ``address`` (Nagle off: control messages are tiny and
    latency-bound)."""
    host, port = split_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=remaining(deadline))
    except TimeoutError:
        raise PeerError(f"p2p connect to {address} timed out", "timeout") from None
    except OSError as e:
        raise PeerError(f"p2p connect to {address} failed: {e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
