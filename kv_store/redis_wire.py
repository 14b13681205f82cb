"""The raw RESP pieces of the Redis store's fast paths (kv_store/redis_backend.py): gather
writes of a record's parts with ``sendmsg`` and bulk replies received straight into caller
buffers with ``recvmsg_into``, on a connection redis-py's pool opened and authenticated."""

from __future__ import annotations

import socket
from collections.abc import Sequence

import redis

from kv_store.backend import Blob

_LINE_READ = 64  # bytes asked for when reading a reply line: little payload is over-read
_MAX_LINE = 4096
_IOV_MAX = 1024

# ``bulk_into``'s answer for a key that holds another Redis type (a list, a hash...).
WRONG_TYPE = -1


def byte_views(bufs: Sequence[Blob], name: str, *, writable: bool) -> list[memoryview]:
    """Byte views of ``bufs``; ``ValueError`` naming the buffer if one is not C-contiguous
    (or, for ``writable``, is read-only)."""
    views = []
    for j, b in enumerate(bufs):
        try:
            v = memoryview(b).cast("B")
        except TypeError as e:
            raise ValueError(f"{name}[{j}] must be a C-contiguous buffer: {e}") from None
        if writable and v.readonly:
            raise ValueError(f"{name}[{j}] is read-only; values are received into it")
        views.append(v)
    return views


def send_all(sock: socket.socket, bufs: Sequence[Blob]) -> None:
    """``sendmsg`` every byte of ``bufs`` (gather write; resumes after a partial send)."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if v.nbytes]
    while views:
        n = sock.sendmsg(views[:_IOV_MAX])
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]


class ReplyReader:
    """Reads RESP bulk-string replies (``GET``) from a connected socket, each value straight
    into caller buffers. Raises ``redis.ResponseError`` for an error reply and
    ``redis.ConnectionError`` for a closed connection or anything that is not a bulk
    string (both leave the connection unusable)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pending = bytearray()  # received but not yet consumed

    def _recv_some(self) -> None:
        chunk = self._sock.recv(_LINE_READ)
        if not chunk:
            raise redis.ConnectionError("connection closed by server")
        self._pending += chunk

    def _line(self) -> bytes:
        while (end := self._pending.find(b"\r\n")) < 0:
            if len(self._pending) > _MAX_LINE:
                raise redis.ConnectionError("protocol error: reply line too long")
            self._recv_some()
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line

    def _read_into(self, views: list[memoryview]) -> None:
        """Fill ``views`` completely: first from what is pending, then from the socket."""
        todo = [v for v in views if v.nbytes]
        while todo and self._pending:
            n = min(len(self._pending), todo[0].nbytes)
            todo[0][:n] = self._pending[:n]
            del self._pending[:n]
            todo[0] = todo[0][n:]
            if not todo[0].nbytes:
                todo.pop(0)
        while todo:
            # One scatter read fills many buffers (a block is 2 x layers cache slices).
            n = self._sock.recvmsg_into(todo[:_IOV_MAX])[0]
            if n == 0:
                raise redis.ConnectionError("connection closed by server")
            while todo and n >= todo[0].nbytes:
                n -= todo[0].nbytes
                todo.pop(0)
            if n:
                todo[0] = todo[0][n:]

    def bulk_into(self, views: list[memoryview]) -> int | None:
        """Read one bulk reply into ``views`` if its size is their total (else discard
        it); its size, or None for a missing key."""
        line = self._line()
        if line.startswith(b"-WRONGTYPE"):
            return WRONG_TYPE  # one line: the replies that follow stay in step
        if line[:1] == b"-":
            raise redis.ResponseError(line[1:].decode("utf-8", "replace"))
        if line in (b"$-1", b"_"):  # RESP2 / RESP3 null
            return None
        if line[:1] != b"$" or not line[1:].isdigit():
            raise redis.ConnectionError(f"protocol error: unexpected reply {line[:40]!r}")
        size = int(line[1:])
        want = sum(v.nbytes for v in views)
        if size == want:
            self._read_into(views)
        else:
            scratch = memoryview(bytearray(min(size, 1 << 20)))
            left = size
            while left:
                n = min(left, scratch.nbytes)
                self._read_into([scratch[:n]])
                left -= n
        crlf = memoryview(bytearray(2))
        self._read_into([crlf])
        if crlf != b"\r\n":
            raise redis.ConnectionError("protocol error: bulk string not followed by CRLF")
        return size
