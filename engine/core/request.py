"""Request: pure per-request state. The scheduler owns the queues, the KV manager the blocks."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.block_hash import ROOT_PARENT, hash_block_tokens
from engine.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    # Both are asked per request per step: constant lookups, not a tuple/dict built per call.
    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True)
class RemoteKV:
    """Where to load a request's prompt KV from: the store keys of its leading blocks, or
    (p2p) the prefill instance holding them (``source_address``) and its lease
    (``transfer_id``)."""

    block_keys: list[str]
    num_tokens: int
    source_address: str = ""
    transfer_id: str = ""
    # The prefill's grid differs from this engine's: how the load re-cuts its blocks
    # (``kv_store.reshard.Reshard`` as JSON; docs/design.md §3 "KV between unlike grids").
    reshard: dict[str, Any] | None = None


@dataclass(eq=False, slots=True)
class Request:
    """A request's tokens and progress. There is no prefill or decode phase: only
    ``num_computed_tokens`` (KV present in the cache) against ``num_tokens``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the local prefix cache
    block_hashes: list[bytes] = field(default_factory=list)  # full blocks only
    remote_kv: RemoteKV | None = None
    save_kv: bool = False
    num_preemptions: int = 0
    stop_reason: str | int | None = None
    # Tokens handed in already generated (first token from prefill, or resume); they count
    # toward max_tokens but are never re-emitted.
    num_initial_output_tokens: int = 0
    first_scheduled_time: float | None = None
    kv_load_seconds: float = 0.0
    kv_blocks_loaded: int = 0
    kv_blocks_recomputed: int = 0
    kv_blocks_local: int = 0  # prompt blocks this instance held already (not moved)
    kv_bytes_loaded: int = 0
    # Logprob of prompt token i + 1 at index i (engine/sampling/prompt_logprobs.py); sent once.
    prompt_logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Seed for the per-position random draws: the user's, or one the engine picked.
    effective_seed: int = 0
    # Called as f(output_token_ids, logits) -> logits before sampling (grammar masks).
    logits_processors: list[Callable[[list[int], Any], Any]] = field(default_factory=list)
    # Draft tokens proposed for this step (speculative decoding); never part of the output
    # until the target model verifies them.
    spec_token_ids: list[int] = field(default_factory=list)
    # LoRA (engine/lora/): the adapter's name (None: the base model) and identity, the GPU slot it
    # holds while scheduled (-1: none), the parent of its block-hash chain (adapter
    # identity, common/block_hash.py) and when waiting for a slot ends in failure.
    lora_name: str | None = None
    lora_identity: str = ""
    lora_slot: int = -1
    hash_root: bytes = ROOT_PARENT
    lora_deadline: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A new list (prompt + output): O(length). Hot paths use ``token_ids_slice``."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole prompt + output list,
        so a decode step's one-token slice costs O(1), not O(length)."""
        prompt = self.prompt_token_ids
        n_prompt = len(prompt)
        if end <= n_prompt:
            return prompt[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return prompt[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def tokens_left(self, max_model_len: int) -> int:
        """How many more tokens this request may produce: the one rule for "length", the
        smaller of what ``max_tokens`` and the model's length still allow."""
        return min(
            self.params.max_tokens - len(self.output_token_ids), max_model_len - self.num_tokens
        )

    @property
    def below_min_tokens(self) -> bool:
        """Fewer tokens than ``min_tokens`` so far: EOS and stop tokens are masked."""
        return len(self.output_token_ids) < self.params.min_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def update_block_hashes(self, block_size: int) -> None:
        """Hash any newly completed full blocks (prompt and output alike)."""
        hashes = self.block_hashes
        n_full = self.num_tokens // block_size
        if len(hashes) < n_full:
            # Block by block from the new ones only (same chain as ``extend_block_hashes``),
            # so a long request does not copy its whole token list per completed block.
            parent = hashes[-1] if hashes else self.hash_root
            for i in range(len(hashes), n_full):
                parent = hash_block_tokens(
                    parent, self.token_ids_slice(i * block_size, (i + 1) * block_size)
                )
                hashes.append(parent)

    def __lt__(self, other: Request) -> bool:  # heap order for the priority policy
        return (self.priority, self.arrival_time) < (other.priority, other.arrival_time)
