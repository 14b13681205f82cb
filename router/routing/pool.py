"""One pool of engine instances (prefill or decode): channels, health, load, selection.

The pool follows its discovery source, keeps one gRPC channel per instance, and runs an
active health loop: every ``health_interval`` seconds each instance must answer the
standard ``grpc.health.v1`` Check with SERVING and ``GetLoad`` (not draining), both within
``check_timeout``, or it is taken out; it is put back as soon as it passes again. A failed
call during a request takes the instance out at once (passive check) until the next pass.
A check that gets no answer also sets ``Instance.lost``, which fails the instance's
in-flight decode streams over (``router.legs.stream_watch``); draining does not. One check
that misses its deadline while the previous one passed is forgiven (``MISSES_FORGIVEN``):
a burst of work (hundreds of streams opened and cancelled at once) can delay one answer
on a live instance, and taking it out then failed every stream on it over and turned new
requests into 503s. Two misses in a row, or a refused connection, take it out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_tls import TlsFiles, channel_options
from pdserve_api.v1 import pdserve_pb2, pdserve_pb2_grpc
from router.lora import lora_candidates
from router.metrics import RouterMetrics
from router.routing.kv_events import KvEventFeeds
from router.routing.kv_index import KvBlockIndex, TierWeights
from router.routing.policies import Policy, RouteContext, RouteNote, make_policy
from router.routing.prefix_index import PrefixIndex
from router.routing.prefix_match import PrefixMatcher
from router.routing.service_auth import IdentityNotProven, ServiceIdentity

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    # Notice a peer that vanished without closing its socket (node loss) within seconds.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # Fail fast and let the router pick another instance instead of gRPC's own backoff.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


# Consecutive missed check deadlines tolerated on a healthy instance (module docstring).
MISSES_FORGIVEN = 1


class Discovery(Protocol):
    def snapshot(self) -> set[str]: ...

    async def run(self, stop: asyncio.Event) -> None: ...


@dataclass(slots=True)
class LoadSnapshot:
    waiting: int = 0
    running: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    prefix_hit_rate: float = 0.0
    model_fingerprint: str = ""
    model_name: str = ""
    draining: bool = False
    lora_adapters: tuple[str, ...] = ()  # served by the instance (router/lora.py)
    resident_lora_adapters: tuple[str, ...] = ()  # of those, in a device slot now

    @property
    def kv_usage(self) -> float:
        if self.total_kv_blocks <= 0:
            return 0.0
        return 1.0 - self.free_kv_blocks / self.total_kv_blocks


@dataclass(slots=True)
class Instance:
    """One engine endpoint. ``stub`` is a PrefillServiceStub or DecodeServiceStub."""

    url: str
    pool: str
    channel: grpc.aio.Channel
    stub: Any
    health: health_pb2_grpc.HealthStub
    healthy: bool = False
    load: LoadSnapshot = field(default_factory=LoadSnapshot)
    sent_since_poll: int = 0  # requests routed here since the last GetLoad, not yet in ``load``
    inflight: int = 0
    last_error: str = ""
    # The control-plane credential of each call (router/routing/service_auth.py).
    auth: ServiceIdentity = field(default_factory=ServiceIdentity)
    # DecodeService on the same channel: a prefill instance serves whole requests when no
    # decode instance is healthy (docs/design.md §5); for decode instances, ``stub`` itself.
    decode_stub: Any = None
    # Set when a health check got no answer (hung or gone, not draining): streams on the
    # instance fail over at once (router.legs.stream_watch). Replaced when it passes again.
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    missed: int = 0  # consecutive checks that missed their deadline (module docstring)

    def note_adapter(self, name: str, served: bool) -> None:
        """A LoRA load or unload this instance just confirmed, ahead of the next GetLoad
        (router/openai/lora_admin.py): the adapter answers as soon as its load returns."""
        have = [a for a in self.load.lora_adapters if a != name]
        self.load.lora_adapters = (*have, name) if served else tuple(have)
        if not served:
            self.load.resident_lora_adapters = tuple(
                a for a in self.load.resident_lora_adapters if a != name
            )

    def load_score(self) -> float:
        return self.load.waiting * 4 + self.load.running + self.sent_since_poll


class InstancePool:
    """Instances of one role, their health and the routing policy that picks among them."""

    def __init__(
        self,
        name: str,
        discovery: Discovery,
        *,
        policy: str = "least_load",
        metrics: RouterMetrics | None = None,
        health_interval: float = 2.0,
        check_timeout: float = 1.0,
        prefix_index_blocks: int = 16384,
        grpc_token: str = "",
        tls: TlsFiles | None = None,
        tls_server_name: str = "",
        kv_events: bool = True,
        kv_index_max_entries: int = 500_000,
        kv_pending_window: float = 10.0,
        tier_weights: TierWeights | None = None,
        prefix_load_weight: float = 1.0,
    ) -> None:
        if name not in ("prefill", "decode"):
            raise ValueError(f"pool name must be 'prefill' or 'decode', got {name!r}")
        if health_interval <= 0 or check_timeout <= 0:
            raise ValueError("health_interval and check_timeout must be > 0")
        self.name = name
        self.discovery = discovery
        self.metrics = metrics
        self.health_interval = health_interval
        self.check_timeout = check_timeout
        self.grpc_token = grpc_token
        # mTLS (docs/design.md §3, "Control-plane security"): one set of credentials for
        # every instance; the name checked in their certificates is the dialed host unless
        # ``tls_server_name`` overrides it.
        self._credentials = tls.channel_credentials() if tls is not None else None
        self._channel_options = CHANNEL_OPTIONS + channel_options(tls_server_name)
        # What routing knows of each instance's cache (docs/design.md §5): the event index
        # while its KV event stream is live, else the guess of what was sent there.
        self.prefix_index = PrefixIndex(prefix_index_blocks)
        self.kv_index = KvBlockIndex(kv_index_max_entries, tier_weights)
        self.kv_feeds = KvEventFeeds(name, self.kv_index, metrics) if kv_events else None
        self.matcher = PrefixMatcher(
            self.kv_index, self.prefix_index, self.events_live, kv_pending_window
        )
        self.policy: Policy = make_policy(policy, self.matcher, prefix_load_weight)
        self._instances: dict[str, Instance] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # Called after each passing health poll (router/openai/lora_admin.py syncs adapters).
        self.on_polled: Callable[[Instance], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Connect to the current instances, check them once, then keep checking."""
        self._stop.clear()
        self._tasks.append(
            asyncio.create_task(self.discovery.run(self._stop), name=f"{self.name}-discovery")
        )
        await asyncio.sleep(0)  # let discovery publish its first set
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._health_loop(), name=f"{self.name}-health"))

    async def stop(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 5.0)
        self._tasks.clear()
        for url in list(self._instances):
            await self._remove(url)

    async def _health_loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.health_interval)
            if self._stop.is_set():
                return
            try:
                await self.refresh()
            except Exception:  # the loop must survive anything a check throws
                logger.exception("%s pool: health round failed", self.name)
            if self.kv_feeds is not None:
                self.kv_feeds.publish_gauges()

    async def refresh(self) -> None:
        """Sync with discovery and check every instance once (concurrently)."""
        wanted = self.discovery.snapshot()
        for url in set(self._instances) - wanted:
            await self._remove(url)
        for url in wanted - set(self._instances):
            self._add(url)
        await asyncio.gather(*(self._check(inst) for inst in list(self._instances.values())))

    def _add(self, url: str) -> None:
        channel = (
            grpc.aio.insecure_channel(url, options=CHANNEL_OPTIONS)
            if self._credentials is None
            else grpc.aio.secure_channel(url, self._credentials, options=self._channel_options)
        )
        decode_stub = pdserve_pb2_grpc.DecodeServiceStub(channel)
        self._instances[url] = Instance(
            url,
            self.name,
            channel,
            pdserve_pb2_grpc.PrefillServiceStub(channel) if self.name == "prefill" else decode_stub,
            health_pb2_grpc.HealthStub(channel),
            auth=ServiceIdentity(self.grpc_token),
            decode_stub=decode_stub,
        )
        if self.kv_feeds is not None:
            self.kv_feeds.add(url, self._instances[url].stub, self._instances[url].auth)
        logger.info("%s pool: added %s", self.name, url)

    async def _remove(self, url: str) -> None:
        inst = self._instances.pop(url, None)
        if inst is None:
            return
        self.prefix_index.forget(url)
        if self.kv_feeds is not None:
            await self.kv_feeds.remove(url)
        if self.metrics is not None:
            self.metrics.remove_instance(self.name, url)
        # Grace lets in-flight streams on a leaving instance finish.
        with contextlib.suppress(Exception):
            await inst.channel.close(grace=1.0)
        logger.info("%s pool: removed %s", self.name, url)

    async def _check(self, inst: Instance) -> None:
        try:
            reply = await inst.health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self.check_timeout
            )
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                raise _Unhealthy(
                    f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
                )
            await inst.auth.prove(inst.stub, self.check_timeout)
            info = await inst.stub.GetLoad(
                pdserve_pb2.GetLoadRequest(),
                timeout=self.check_timeout,
                metadata=inst.auth.metadata("GetLoad"),
            )
            if info.draining:
                raise _Unhealthy("draining")
        except (grpc.RpcError, _Unhealthy, IdentityNotProven) as exc:
            if _forgiven(inst, exc):
                logger.info("%s pool: %s answered late (%s); kept in", self.name, inst.url,
                            _describe(exc))  # fmt: skip
                return
            self._set_health(inst, False, _describe(exc))
            if isinstance(exc, grpc.RpcError):
                inst.lost.set()  # no answer: its streams would stall, so fail them over now
            return
        inst.load = LoadSnapshot(
            waiting=info.waiting,
            running=info.running,
            free_kv_blocks=info.free_kv_blocks,
            total_kv_blocks=info.total_kv_blocks,
            prefix_hit_rate=info.prefix_hit_rate,
            model_fingerprint=info.model_fingerprint,
            model_name=info.model_name,
            draining=info.draining,
            lora_adapters=tuple(info.lora_adapters),
            resident_lora_adapters=tuple(info.resident_lora_adapters),
        )
        inst.sent_since_poll = 0
        inst.missed = 0
        self._set_health(inst, True, "")
        if self.on_polled is not None:
            self.on_polled(inst)

    def _set_health(self, inst: Instance, healthy: bool, reason: str) -> None:
        if healthy and inst.lost.is_set():
            inst.lost = asyncio.Event()  # back: new streams get a fresh signal
        if inst.healthy != healthy:
            if healthy:
                logger.info("%s pool: %s is healthy", self.name, inst.url)
            else:
                logger.warning("%s pool: taking out %s (%s)", self.name, inst.url, reason)
        inst.healthy = healthy
        inst.last_error = reason
        if self.metrics is not None:
            load = inst.load
            self.metrics.set_instance(
                self.name,
                inst.url,
                healthy=healthy,
                waiting=load.waiting,
                running=load.running,
                kv_usage=load.kv_usage,
            )

    # -- request path ------------------------------------------------------------------
    def instances(self) -> list[Instance]:
        return list(self._instances.values())

    def healthy(self, exclude: Iterable[str] = ()) -> list[Instance]:
        skip = set(exclude)
        return [i for i in self._instances.values() if i.healthy and i.url not in skip]

    def select(self, ctx: RouteContext, exclude: Iterable[str] = ()) -> Instance | None:
        """Pick a healthy instance not in ``exclude`` by the pool's policy; None if none."""
        candidates: Sequence[Instance] = self.healthy(exclude)
        if ctx.lora_name is not None:  # only instances serving the adapter can run it
            candidates = lora_candidates(candidates, ctx.lora_name)
        if not candidates:
            return None
        pinned = [c for c in candidates if c.url == ctx.pin]
        if pinned:
            chosen = pinned[0]
            ctx.note = RouteNote("pinned")
        else:
            picked = self.policy.select(candidates, ctx)
            assert isinstance(picked, Instance)
            chosen = picked
        if self.metrics is not None and ctx.note is not None:
            self.metrics.route_choices.labels(self.name, ctx.note.reason).inc()
        chosen.sent_since_poll += 1
        if ctx.block_hashes:
            self.prefix_index.record(chosen.url, ctx.block_hashes)
        return chosen

    def events_live(self, url: str) -> bool:
        """Whether the event index speaks for ``url`` now (its stream is live)."""
        return self.kv_feeds is not None and self.kv_feeds.live(url)

    def _events_state(self, url: str) -> str:
        sub = self.kv_feeds.subscribers.get(url) if self.kv_feeds is not None else None
        if sub is None:
            return "off"
        return "live" if sub.live else ("unsupported" if sub.unsupported else "down")

    def mark_failed(self, inst: Instance, reason: str) -> None:
        """Take ``inst`` out until its next passing health check (a call to it just failed)."""
        self._set_health(inst, False, reason)

    def status(self) -> dict[str, Any]:
        return {
            "healthy": sum(1 for i in self._instances.values() if i.healthy),
            "total": len(self._instances),
            "instances": {
                i.url: {
                    "healthy": i.healthy,
                    "inflight": i.inflight,
                    "waiting": i.load.waiting,
                    "running": i.load.running,
                    "error": i.last_error or None,
                    "kv_events": self._events_state(i.url),
                }
                for i in self._instances.values()
            },
        }


class _Unhealthy(Exception):
    pass


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


def _forgiven(inst: Instance, exc: BaseException) -> bool:
    """A deadline missed by a healthy instance whose previous check passed: counted, not
    acted on (module docstring)."""
    late = isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    if late and inst.healthy and inst.missed < MISSES_FORGIVEN:
        inst.missed += 1
        return True
    return False
