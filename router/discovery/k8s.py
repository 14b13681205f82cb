"""Kubernetes discovery: the ready endpoints of a Service, from its EndpointSlices.

List + watch through the ``kubernetes`` client, with periodic resync and exponential
backoff on errors, so instances join and leave without a router restart. Importable
without the ``kubernetes`` package: it is imported lazily, inside the functions that use it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from common.kube_client import make_api_client
from router.discovery.base import ChangeCallback, InstanceDiscovery, format_hostport

logger = logging.getLogger(__name__)


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
