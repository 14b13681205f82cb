"""Redis block store (docs/design.md §3 ``redis``): redis-py with a connection pool.

Batches go out as one pipelined round trip (``MGET`` for reads, ``SET … EX`` for writes).
The connector's fast paths skip the copies redis-py would make of multi-MiB values while
still using its connection pool (connect, auth, retries, timeouts): ``put_parts`` sends a
record's pieces straight from the paged cache (``sendmsg``) and reads the replies with
redis-py; ``get_into`` receives values straight into the cache (``recvmsg_into``) instead
of through redis-py's reply parser, which copies every value twice before we can.
Every socket operation has a timeout (``socket_timeout_s``, never retried: a hung server
would make each retry wait again) and refused/reset connections are retried a bounded
number of times with backoff, so a dead or hung server turns into ``KVStoreError`` within
one timeout. After ``breaker_threshold`` consecutive failures a circuit breaker
(``kv_store.breaker``) fails operations at once for ``breaker_open_s`` seconds, so
transfers never queue behind each other's timeouts.
Redis ``SET`` is atomic: a reader never sees a torn value. Values expire after ``ttl_s``
(server-side ``EX``); for a hard memory bound also run the server with ``maxmemory`` and an
eviction policy such as ``allkeys-lru``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import redis
from redis._parsers import Encoder
from redis.backoff import ExponentialBackoff
from redis.connection import PythonRespSerializer
from redis.retry import Retry

from kv_store.backend import Blob, VectoredBackend
from kv_store.base import KVStoreError
from kv_store.breaker import CircuitBreaker
from kv_store.redis_wire import WRONG_TYPE, ReplyReader, byte_views, send_all

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _chunks(items: Sequence[T], n: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (``redis://:secret@h`` → ``redis://:***@h``):
    the URL goes into logs, metrics names and error messages."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"


class RedisBackend(VectoredBackend):
    """A ``StorageBackend`` over one Redis server (``redis://host:port/db``)."""

    def __init__(
        self,
        url: str,
        *,
        ttl_s: float | None = None,
        key_prefix: str = "",
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
        retries: int = 2,
        max_connections: int = 16,
        batch_keys: int = 32,
        breaker_threshold: int = 3,
        breaker_open_s: float = 5.0,
    ) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"redis_url must start with redis://, rediss:// or unix://, got {redact_url(url)!r}"
            )
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 (or None for no TTL), got {ttl_s}")
        if batch_keys < 1:
            raise ValueError(f"batch_keys must be >= 1, got {batch_keys}")
        self.url = url
        self.shown_url = redact_url(url)  # what logs and errors may carry
        # EX takes whole seconds; round up so a TTL never expires early.
        self.ttl_s = None if ttl_s is None else max(1, math.ceil(ttl_s))
        self.key_prefix = key_prefix
        self.batch_keys = batch_keys
        self.breaker = CircuitBreaker(
            f"redis {self.shown_url}", threshold=breaker_threshold, open_s=breaker_open_s
        )
        # Only refused/reset connections are retried (redis-py's default also retries
        # timeouts, which against a hung server multiplies the wait by retries + 1).
        retry = Retry(
            ExponentialBackoff(cap=0.5, base=0.05),
            retries,
            supported_errors=(redis.ConnectionError,),
        )
        try:
            self._client: Any = redis.Redis.from_url(
                url,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=connect_timeout_s,
                retry=retry,
                # Retry refused/reset connections (cheap), never a timeout: a hung server
                # would make each retry wait socket_timeout again.
                retry_on_error=[redis.ConnectionError],
                max_connections=max_connections,
                health_check_interval=30,
                # With hiredis installed redis-py would pack each command into one joined
                # buffer, copying every multi-MiB record; the Python packer sends large
                # values as their own buffers. (hiredis still parses replies: 2x faster GETs.)
                command_packer=PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode),
            )
        except ValueError as e:
            raise ValueError(f"invalid redis_url {redact_url(url)!r}: {e}") from None

    def _k(self, key: str) -> str:
        return self.key_prefix + key

    def ping(self) -> None:
        """Round-trip to the server; ``KVStoreError`` if it cannot be reached."""
        try:
            self._client.ping()
        except redis.RedisError as e:
            raise KVStoreError(f"redis {self.shown_url} unreachable: {e}") from e

    def _guarded(self, fn: Callable[[], T]) -> T:
        """``fn()`` through the circuit breaker, redis-py errors as ``KVStoreError``."""

        def once() -> T:
            try:
                return fn()
            except redis.RedisError as e:
                raise KVStoreError(f"redis {self.shown_url} unreachable: {e}") from e

        return self.breaker.call(once)

    def exists(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []

        def run() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._k(key))
            return [bool(n) for n in pipe.execute()]

        return self._guarded(run)

    def get(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []

        def run() -> list[bytes | None]:
            pipe = self._client.pipeline(transaction=False)
            for batch in _chunks(keys, self.batch_keys):
                pipe.mget([self._k(k) for k in batch])
            return [v for part in pipe.execute() for v in part]

        return self._guarded(run)

    @property
    def vectored_io(self) -> bool:
        """Whether ``get_into`` works here: plain TCP or unix sockets (a TLS socket has no
        ``recvmsg_into``)."""
        return not self.url.startswith("rediss://")

    def read_into(self, keys: list[str], parts: Sequence[Sequence[Blob]]) -> list[int | None]:
        """One pipelined batch (``get_into``)."""
        return self.get_into(keys, parts)

    def get_into(self, keys: list[str], parts: Sequence[Sequence[Blob]]) -> list[int | None]:
        """Pipelined ``GET``s of ``keys``; a value whose size equals the total of its
        writable buffers ``parts[i]`` is received straight into them. Returns per key the
        value's size (when it differs from the total, nothing was written — fall back to
        ``get``) or None when missing. Buffers of a later key may be written even when an
        earlier one is missing or mismatched."""
        if len(keys) != len(parts):
            raise ValueError(f"get_into: {len(keys)} keys but {len(parts)} buffer lists")
        if not keys:
            return []
        if not self.vectored_io:
            raise ValueError(f"get_into needs a redis:// or unix:// URL, not {self.shown_url!r}")
        # Checked before anything is sent: a bad buffer found mid-reply would leave earlier
        # keys' buffers written and raise a TypeError from inside the socket loop.
        views = [byte_views(bufs, f"parts[{i}]", writable=True) for i, bufs in enumerate(parts)]
        return self._guarded(
            lambda: self._client.get_retry().call_with_retry(
                lambda: self._get_into_once(keys, views), lambda _err: None
            )
        )

    @contextlib.contextmanager
    def _raw_connection(self, doing: str) -> Iterator[Any]:
        """A pooled connection whose socket we read or write ourselves. Socket errors
        become redis-py's (so its retry policy applies), and a connection left mid-reply
        by any error is dropped, never reused."""
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            yield conn
        except TimeoutError as e:  # socket.timeout: nothing within socket_timeout
            conn.disconnect()
            raise redis.TimeoutError(f"timeout {doing}: {e}") from e
        except OSError as e:
            conn.disconnect()
            raise redis.ConnectionError(f"error {doing}: {e}") from e
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def _get_into_once(self, keys: list[str], views: list[list[memoryview]]) -> list[int | None]:
        # The pool hands out a connection with no unread data (it checks), so its replies
        # start at our first GET; redis-py's parser is not used and holds nothing.
        with self._raw_connection("reading a reply") as conn:
            conn.send_packed_command(conn.pack_commands([("GET", self._k(k)) for k in keys]))
            reader = ReplyReader(conn._sock)  # noqa: SLF001 - the connection's own socket
            sizes = [reader.bulk_into(v) for v in views]
        # A key holding another type (WRONGTYPE) is a bad record, not an outage: it reads
        # as missing (recomputed) and is deleted, and the breaker counts a success.
        bad = [key for key, size in zip(keys, sizes, strict=True) if size == WRONG_TYPE]
        if bad:
            logger.warning(
                "redis %s: %d record(s) of the wrong type; deleting", self.shown_url, len(bad)
            )
            self._client.delete(*[self._k(k) for k in bad])
        return [None if size == WRONG_TYPE else size for size in sizes]

    def put_parts(self, items: Sequence[tuple[str, Sequence[Blob]]]) -> None:
        """Like ``put``, each value given as pieces sent back to back in one pipelined
        batch, so a record goes from the cache to the socket without being assembled."""
        if not items:
            return
        views = [
            (key, byte_views(parts, f"items[{i}]", writable=False))
            for i, (key, parts) in enumerate(items)
        ]
        if not self.vectored_io:
            self.put([(key, b"".join(parts)) for key, parts in views])
            return
        self._guarded(
            lambda: self._client.get_retry().call_with_retry(
                lambda: self._put_parts_once(views), lambda _err: None
            )
        )

    def _put_parts_once(self, items: Sequence[tuple[str, list[memoryview]]]) -> None:
        ex = (
            b""
            if self.ttl_s is None
            else b"$2\r\nEX\r\n$%d\r\n%d\r\n"
            % (
                len(str(self.ttl_s)),
                self.ttl_s,
            )
        )
        nargs = 3 if self.ttl_s is None else 5
        bufs: list[Blob] = []
        for key, views in items:
            k = self._k(key).encode()
            size = sum(v.nbytes for v in views)
            bufs.append(b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (nargs, len(k), k, size))
            bufs += views
            bufs.append(b"\r\n" + ex)
        with self._raw_connection("sending values") as conn:
            send_all(conn._sock, bufs)  # noqa: SLF001 - the connection's own socket
            for _ in items:
                reply = conn.read_response()  # redis-py raises on an error reply
                if reply not in (b"OK", "OK", True):
                    raise redis.ResponseError(f"unexpected SET reply {reply!r}")

    def put(self, items: Sequence[tuple[str, Blob]]) -> None:
        if not items:
            return

        def run() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(self._k(key), value, ex=self.ttl_s)
            pipe.execute()

        self._guarded(run)

    def delete(self, keys: list[str]) -> None:
        if not keys:
            return
        self._guarded(lambda: self._client.delete(*[self._k(k) for k in keys]))

    def close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()
