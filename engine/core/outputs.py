"""What the engine hands back for a request: per-step deltas, logprobs, the KV it saved,
and the offline ``LLM``'s results. The engine-wide snapshot is ``engine/stats.py``."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    kv_blocks_local: int = 0  # a handoff's prompt blocks found in this instance's cache
    kv_bytes_loaded: int = 0  # what the handoff's load moved
    queue_seconds: float = 0.0
    error: str | None = None  # set when the engine failed the request (e.g. KV load, policy "fail")
    # Logprob of prompt token i + 1 at index i (SamplingParams.prompt_logprobs), on the
    # first sampled token's output only; empty when the prompt's KV was loaded, not computed.
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """The offline ``LLM.generate`` result for one prompt."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # as RequestOutput's
