"""Where the router finds its prefill and decode instances (DESIGN §5).

One small interface, three sources:

* ``StaticDiscovery``: a fixed ``host:port`` list (``--prefill-urls``/``--decode-urls``).
* ``EndpointSliceDiscovery``: the ready endpoints of a (headless) Kubernetes Service,
  kept current by list + watch of its EndpointSlices through the ``kubernetes`` client,
  with periodic resync and exponential backoff on errors. Instances join and leave
  without a router restart.
* ``DnsDiscovery``: the A/AAAA records of a headless Service, re-resolved periodically;
  the fallback when the router may not read the API (no RBAC, other orchestrators).

Torch-free and importable without the ``kubernetes`` package (it is imported lazily by
the one class that needs it). Every network wait carries a deadline.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ChangeCallback = Callable[[set[str]], None]
Resolver = Callable[[str, int], Awaitable[set[str]]]


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


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter: delay for the n-th consecutive failure."""

    initial: float = 0.5
    maximum: float = 30.0
    factor: float = 2.0

    def delay(self, attempt: int) -> float:
        ceiling = min(self.maximum, self.initial * self.factor ** max(attempt, 0))
        # Jitter spreads the retries of many router replicas after an API outage.
        return random.uniform(ceiling / 2, ceiling)


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


def make_api_client(api_url: str | None = None, request_timeout: float = 10.0) -> Any:
    """A ``kubernetes.client.ApiClient``: in-cluster config when running in a pod, else
    ``api_url`` (e.g. ``kubectl proxy``'s http://127.0.0.1:8001), else ~/.kube/config."""
    from kubernetes import client, config

    if api_url:
        cfg = client.Configuration()
        cfg.host = api_url.rstrip("/")
        return client.ApiClient(cfg)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class _Relist(Exception):
    """The watch cannot continue from its resourceVersion: list again."""


class EndpointSliceDiscovery(InstanceDiscovery):
    """Ready endpoints of Service ``service`` in ``namespace``, from its EndpointSlices.

    A daemon thread runs the blocking ``kubernetes`` client: list the slices labelled
    ``kubernetes.io/service-name=<service>``, then watch from the list's resourceVersion;
    each watch asks the server to end after ``watch_timeout`` seconds (and the client
    gives up reading ``request_timeout`` seconds later), after which it re-watches; every
    ``resync`` seconds, or when the resourceVersion expires (410), it lists again. Errors
    back off exponentially. An endpoint counts when its ``ready`` condition is not false
    (Kubernetes: unset means ready); its port is the slice port named ``port_name`` when
    present, else ``port``.
    """

    def __init__(
        self,
        namespace: str,
        service: str,
        port: int,
        *,
        port_name: str | None = "grpc",
        api_client: Any = None,
        api_url: str | None = None,
        resync: float = 300.0,
        watch_timeout: float = 60.0,
        request_timeout: float = 10.0,
        backoff: Backoff | None = None,
        on_change: ChangeCallback | None = None,
    ) -> None:
        super().__init__(on_change)
        if not namespace or not service or not 0 < port < 65536:
            raise ValueError("EndpointSliceDiscovery needs a namespace, a service and a port")
        if min(resync, watch_timeout, request_timeout) <= 0:
            raise ValueError("resync, watch_timeout and request_timeout must be positive")
        try:
            import kubernetes  # noqa: F401  (fail here, not in the watch thread)
        except ImportError as exc:
            raise RuntimeError(
                "k8s discovery needs the 'kubernetes' package (pip install kubernetes)"
            ) from exc
        self.namespace, self.service, self.port, self.port_name = (
            namespace,
            service,
            port,
            port_name,
        )
        self.resync, self.watch_timeout, self.request_timeout = (
            resync,
            watch_timeout,
            request_timeout,
        )
        self.backoff = backoff or Backoff()
        self._api_client, self._api_url = api_client, api_url
        self._slices: dict[str, set[str]] = {}
        self._stopping = threading.Event()
        self._watch: Any = None

    def __repr__(self) -> str:
        return f"EndpointSliceDiscovery({self.namespace}/{self.service}:{self.port})"

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping.clear()
        thread = threading.Thread(target=self._thread_main, name=f"discovery-{self.service}")
        thread.daemon = True  # a watch blocked on a quiet stream must not hold up exit
        thread.start()
        try:
            await stop.wait()
        finally:
            self._stopping.set()
            if self._watch is not None:
                self._watch.stop()
            # Bounded: the thread notices the flag at its next event or read timeout.
            await asyncio.to_thread(thread.join, 1.0)

    def instances_of(self, slice_obj: dict[str, Any]) -> set[str]:
        """The ``host:port`` of every ready endpoint in one EndpointSlice (a raw dict)."""
        port = self.port
        for entry in slice_obj.get("ports") or []:
            if self.port_name and entry.get("name") == self.port_name and entry.get("port"):
                port = int(entry["port"])
        found: set[str] = set()
        for endpoint in slice_obj.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            found.update(format_hostport(addr, port) for addr in endpoint.get("addresses") or [])
        return found

    def _thread_main(self) -> None:
        from kubernetes import client

        api_client = self._api_client or make_api_client(self._api_url)
        api = client.DiscoveryV1Api(api_client)
        failures = 0
        while not self._stopping.is_set():
            try:
                version = self._relist(api)
                failures = 0
                resync_at = time.monotonic() + self.resync
                while not self._stopping.is_set() and time.monotonic() < resync_at:
                    version = self._watch_once(api, version, resync_at - time.monotonic())
            except _Relist:
                logger.info("%s: watch expired, listing again", self)
            except Exception as exc:  # any API or transport error: back off, then relist
                delay = self.backoff.delay(failures)
                failures += 1
                logger.warning("%s: %r; retrying in %.1fs", self, exc, delay)
                self._stopping.wait(delay)

    def _selector(self) -> str:
        return f"kubernetes.io/service-name={self.service}"

    def _relist(self, api: Any) -> str:
        resp = api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=self._selector(),
            _preload_content=False,
            _request_timeout=self.request_timeout,
        )
        body = json.loads(resp.data)
        slices = {}
        for item in body.get("items") or []:
            if self._owned(item):
                slices[item["metadata"]["name"]] = self.instances_of(item)
        self._slices = slices
        self._publish_slices()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _owned(self, item: dict[str, Any]) -> bool:
        # The API server filters by label already; checking again keeps a foreign slice
        # (a proxy or emulator that ignores the selector) out of the pool.
        labels = (item.get("metadata") or {}).get("labels") or {}
        return bool(labels.get("kubernetes.io/service-name") == self.service)

    def _watch_once(self, api: Any, version: str, remaining: float) -> str:
        """Follow one watch stream; returns the last resourceVersion seen."""
        import urllib3
        from kubernetes import client, watch

        self._watch = watch.Watch()
        server_timeout = max(1, int(min(self.watch_timeout, remaining)))
        kwargs: dict[str, Any] = {
            "label_selector": self._selector(),
            "timeout_seconds": server_timeout,
            "allow_watch_bookmarks": True,
            "_request_timeout": (self.request_timeout, server_timeout + self.request_timeout),
        }
        if version:
            kwargs["resource_version"] = version
        try:
            for event in self._watch.stream(
                api.list_namespaced_endpoint_slice, self.namespace, **kwargs
            ):
                version = self._apply(event) or version
                if self._stopping.is_set():
                    break
        except client.ApiException as exc:
            if exc.status == 410:
                raise _Relist() from exc
            raise
        except urllib3.exceptions.ReadTimeoutError:
            pass  # a quiet stream the server did not close in time: just watch again
        finally:
            self._watch.stop()
        return version

    def _apply(self, event: dict[str, Any]) -> str | None:
        # raw_object is the plain dict (the ERROR events of 410 are raised by the client).
        kind, obj = event.get("type"), event.get("raw_object") or {}
        if kind == "ERROR":
            raise _Relist()
        meta = obj.get("metadata") or {}
        if kind in {"ADDED", "MODIFIED", "DELETED"} and self._owned(obj):
            if kind == "DELETED":
                self._slices.pop(meta.get("name", ""), None)
            else:
                self._slices[meta.get("name", "")] = self.instances_of(obj)
            self._publish_slices()
        return str(meta["resourceVersion"]) if meta.get("resourceVersion") else None

    def _publish_slices(self) -> None:
        merged: set[str] = set()
        for found in self._slices.values():
            merged |= found
        self._publish(merged)


__all__ = [
    "Backoff",
    "DnsDiscovery",
    "EndpointSliceDiscovery",
    "InstanceDiscovery",
    "StaticDiscovery",
    "format_hostport",
    "make_api_client",
    "parse_hostport",
    "resolve_host",
]
