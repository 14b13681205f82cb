"""What the engine hands back: per-step deltas and load statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.spec_decode.decoder import SpecDecodeStats
    from kv_store.p2p.stats import P2PStats
    from kv_store.stats import ConnectorStats


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass(slots=True)
class KvSaveResult:
    """The prompt blocks a producer wrote (or found already present) in the store — or,
    with ``held`` (p2p), kept in this engine's cache for the decode side to pull from
    ``source_address`` under ``transfer_id`` until the lease ends."""

    block_keys: list[str]
    num_tokens: int
    num_blocks_written: int
    seconds: float
    error: str | None = None  # the save failed; decode will find blocks missing and recompute
    held: bool = False
    transfer_id: str = ""
    source_address: str = ""


@dataclass(slots=True)
class RequestOutput:
    """A delta: tokens and text produced since the previous output of this request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_saved: KvSaveResult | None = None
    kv_load_seconds: float = 0.0
    kv_blocks_loaded: int = 0
    kv_blocks_recomputed: int = 0
    queue_seconds: float = 0.0
    error: str | None = None  # set when the engine failed the request (e.g. KV load, policy "fail")


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
class CompletionOutput:
    """The offline ``LLM.generate`` result for one prompt."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


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
    p2p: P2PStats | None = None  # leases and pulls of a p2p connector
