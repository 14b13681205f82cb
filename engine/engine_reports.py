"""``LLMEngine``'s reports to the services: its load and its statistics snapshot (a
collaborator the engine holds, kept apart from the step loop in ``engine/llm_engine.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.stats import EngineStats, LoadStats

if TYPE_CHECKING:
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.scheduler import Scheduler
    from engine.kv.host_tier import HostKvTier
    from engine.kv.transfers import KVTransferCoordinator
    from engine.sampling.guided import GuidedDecoding
    from engine.spec_decode.decoder import SpecDecoder
    from kv_store.base import KVConnector


class EngineReports:
    """Reads the engine's parts; never changes them."""

    def __init__(
        self,
        scheduler: Scheduler,
        guided: GuidedDecoding,
        transfers: KVTransferCoordinator | None,
        kv: KVCacheManager,
        connector: KVConnector | None,
        spec: SpecDecoder | None,
        host_tier: HostKvTier | None,
    ) -> None:
        self.scheduler, self.guided, self.transfers, self.kv = scheduler, guided, transfers, kv
        self.connector, self.spec, self.host_tier = connector, spec, host_tier

    def get_load(self) -> LoadStats:
        return LoadStats(
            waiting=len(self.scheduler.waiting)
            + self.guided.num_pending()
            + (self.transfers.num_waiting_for_kv() if self.transfers else 0),
            running=len(self.scheduler.running),
            free_blocks=self.kv.pool.num_free_blocks,
            total_blocks=self.kv.pool.num_usable_blocks,
            prefix_hit_rate=self.kv.pool.hit_rate(),
            waiting_for_remote_kv=self.transfers.num_waiting_for_kv() if self.transfers else 0,
        )

    def stats(self, load: LoadStats | None = None) -> EngineStats:
        """Load (``load`` if given, else now), connector counters, KV fallbacks and
        speculative counters, as one snapshot."""
        transfers = self.transfers.stats if self.transfers is not None else None
        return EngineStats(
            load or self.get_load(),
            self.connector.name if self.connector is not None else None,
            self.connector.stats() if self.connector is not None else None,
            dict(transfers.load_fallbacks) if transfers else {},
            transfers.blocks_recomputed if transfers else 0,
            self.spec.stats if self.spec is not None else None,
            self.connector.transport_stats() if self.connector is not None else None,
            host_tier=self.host_tier.stats if self.host_tier is not None else None,
            kv_blocks_local=transfers.blocks_local if transfers else 0,
            guided_compiles=dict(self.guided.compile_counts()),
        )
