"""The instance-source contract, shared address helpers and the fixed-list source.

``InstanceDiscovery`` owns the live instance set of one pool; ``StaticDiscovery`` serves a
fixed ``host:port`` list. The watching sources live in ``router.discovery.dns`` and
``router.discovery.k8s``; ``router.discovery`` re-exports all of them.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)

ChangeCallback = Callable[[set[str]], None]


def format_hostport(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals bracketed (``[::1]:50051``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_hostport(text: str) -> tuple[str, int]:
    """Split ``host:port`` / ``[v6]:port``; ValueError with the offending text otherwise."""
    value = text.strip()
    if value.startswith("[") and "]:" in value:
        host, _, port_text = value[1:].partition("]:")
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep:
            raise ValueError(f"instance address {text!r} must be host:port")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"instance address {text!r} must be host:port with port 1-65535")
    return host, int(port_text)


class InstanceDiscovery(abc.ABC):
    """The live set of instances of one pool.

    Contract: ``snapshot()`` is cheap, thread-safe and returns a fresh ``set`` of
    ``"host:port"`` strings (possibly empty). ``run(stop)`` keeps the set current until
    ``stop`` is set, then returns promptly; it never raises for transient source errors
    (they are logged and retried). ``on_change`` (if given) is called on the event loop
    that runs ``run`` with the new set each time it changes.
    """

    def __init__(self, on_change: ChangeCallback | None = None) -> None:
        self._lock = threading.Lock()
        self._instances: set[str] = set()
        self._on_change = on_change
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = asyncio.Event()

    def snapshot(self) -> set[str]:
        with self._lock:
            return set(self._instances)

    @abc.abstractmethod
    async def run(self, stop: asyncio.Event) -> None:
        """Keep the instance set current until ``stop`` is set."""

    async def wait_ready(self, timeout: float) -> bool:
        """True once the source has been read successfully at least once (within timeout)."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _publish(self, instances: Iterable[str]) -> None:
        """Replace the set (callable from any thread); notify on change."""
        new = set(instances)
        with self._lock:
            changed = new != self._instances
            self._instances = new
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # loop closed between the check and the call
            loop.call_soon_threadsafe(self._ready.set)
            if changed:
                logger.info("%s: instances now %s", self, sorted(new))
                if self._on_change is not None:
                    loop.call_soon_threadsafe(self._on_change, set(new))


class StaticDiscovery(InstanceDiscovery):
    """A fixed list, validated up front (``--prefill-urls a:1,b:2``)."""

    def __init__(self, urls: Iterable[str] | str, on_change: ChangeCallback | None = None) -> None:
        super().__init__(on_change)
        items = urls.split(",") if isinstance(urls, str) else list(urls)
        parsed = [parse_hostport(u) for u in items if u.strip()]
        self._instances = {format_hostport(h, p) for h, p in parsed}

    def __repr__(self) -> str:
        return f"StaticDiscovery({sorted(self._instances)})"

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready.set()
        await stop.wait()
