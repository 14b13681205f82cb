"""The engine-wide snapshot the service metrics read (``LLMEngine.stats()``): load, the
connector's counters, remote-KV fallbacks and speculative-decoding counters. It sits at the
top of the engine because it gathers what the parts below report (kept apart from
``core/outputs.py`` so the core imports nothing of speculative decoding or KV stores)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv.events import KvEventStats
    from engine.kv.host_tier import HostTierStats
    from engine.spec_decode.decoder import SpecDecodeStats
    from kv_store.base import ConnectorStats


@dataclass(slots=True)
class LoadStats:
    waiting: int
    running: int
    free_blocks: int
    total_blocks: int
    prefix_hit_rate: float
    waiting_for_remote_kv: int = 0

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine for the service metrics (``LLMEngine.stats()``): its load,
    its connector's counters, remote-KV fallbacks and speculative-decoding counters. Taken
    between steps; the readers never reach into the engine's parts."""

    load: LoadStats
    connector_name: str | None = None
    connector: ConnectorStats | None = None
    kv_load_fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> loads
    kv_blocks_recomputed: int = 0
    spec: SpecDecodeStats | None = None
    # The connector's transport figures (``KVConnectorScheduler.transport_stats``; p2p:
    # leases and pulls), handed on unread: the service exports the kinds it knows.
    transport: object | None = None
    host_tier: HostTierStats | None = None  # the host KV tier's counters, when it is on
    kv_events: KvEventStats | None = None  # the KV event publisher's, when events are on
    kv_blocks_local: int = 0  # handoff prompt blocks found in the prefix cache, not moved
    guided_compiles: dict[str, int] = field(default_factory=dict)  # source -> grammars
    lora: dict[str, float] | None = None  # the LoRA slots' figures, when LoRA is on
