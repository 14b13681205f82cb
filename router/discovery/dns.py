"""DNS discovery: the A/AAAA records of a headless Service, re-resolved periodically.

The fallback when the router may not read the Kubernetes API (no RBAC, other
orchestrators). Every resolve carries a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

from router.discovery.base import ChangeCallback, InstanceDiscovery, format_hostport

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[set[str]]]


async def resolve_host(host: str, port: int, timeout: float = 2.0) -> set[str]:
    """All addresses of ``host`` as ``host:port`` strings, within ``timeout`` seconds.

    Raises ``socket.gaierror`` (name unknown, no records) or ``TimeoutError``.
    """
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(
        loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP),
        timeout,
    )
    return {format_hostport(str(info[4][0]), port) for info in infos}


class DnsDiscovery(InstanceDiscovery):
    """Re-resolve a headless Service name every ``interval`` seconds.

    A headless Service answers with one record per ready pod, so the set follows the
    pool. "No such name / no records" means zero ready pods (the set empties); any other
    failure (timeout, SERVFAIL) keeps the last good set, because dropping every
    instance on a DNS hiccup would fail all traffic.
    """

    _EMPTY_ERRNOS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}

    def __init__(
        self,
        host: str,
        port: int,
        *,
        interval: float = 5.0,
        resolve_timeout: float = 2.0,
        resolver: Resolver | None = None,
        on_change: ChangeCallback | None = None,
    ) -> None:
        super().__init__(on_change)
        if not host or not 0 < port < 65536 or interval <= 0 or resolve_timeout <= 0:
            raise ValueError("DnsDiscovery needs a host, a port 1-65535 and positive intervals")
        self.host, self.port = host, port
        self.interval, self.resolve_timeout = interval, resolve_timeout
        self._resolver = resolver

    def __repr__(self) -> str:
        return f"DnsDiscovery({self.host}:{self.port})"

    async def refresh(self) -> None:
        """Resolve once and publish the result (see the class docstring for errors)."""
        try:
            if self._resolver is not None:
                found = await asyncio.wait_for(
                    self._resolver(self.host, self.port), self.resolve_timeout
                )
            else:
                found = await resolve_host(self.host, self.port, self.resolve_timeout)
        except socket.gaierror as exc:
            if exc.errno not in self._EMPTY_ERRNOS:
                logger.warning("%s: resolve failed (%s); keeping last set", self, exc)
                return
            found = set()
        except (TimeoutError, asyncio.TimeoutError, OSError) as exc:
            logger.warning("%s: resolve failed (%r); keeping last set", self, exc)
            return
        self._publish(found)

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        while not stop.is_set():
            await self.refresh()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)
