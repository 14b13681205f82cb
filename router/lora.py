"""LoRA at the router (docs/lora.md): which adapters the instances serve, the model card
of each, and the adapter-aware choice of candidates.

The router keeps no adapter list of its own: every instance reports the adapters it
serves and the ones in a device slot now in ``GetLoad`` (``LoadInfo.lora_adapters``,
``resident_lora_adapters``), so adapters loaded at runtime appear here with the next
health poll. A request's ``model`` names the base model or one of these adapters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from common.block_hash import adapter_root

# A candidate holding the adapter in a slot is preferred while its load is within this
# many "load units" (``Instance.load_score``) of the least loaded one serving it: a swap
# costs a copy into the slot, and at most an eviction of another adapter.
RESIDENT_SLACK = 4.0


def served_adapters(instances: Iterable[Any]) -> set[str]:
    """Adapters some healthy instance serves."""
    return {name for inst in instances if inst.healthy for name in inst.load.lora_adapters}


def routing_root(lora_name: str | None) -> bytes | None:
    """The root of the router's own block hashes (prefix-aware routing) for an adapter:
    prefixes cached under one adapter are no hit for another. The engines root theirs at
    the adapter's content identity; these never leave the router."""
    return None if lora_name is None else adapter_root(f"router:{lora_name}")


def lora_candidates(candidates: Sequence[Any], lora_name: str) -> list[Any]:
    """The candidates that serve ``lora_name``; those holding it in a slot when their
    load is close to the least loaded one (else all that serve it, to balance)."""
    serving = [c for c in candidates if lora_name in c.load.lora_adapters]
    if not serving:
        return []
    resident = [c for c in serving if lora_name in c.load.resident_lora_adapters]
    if not resident:
        return serving
    least = min(c.load_score() for c in serving)
    close = [c for c in resident if c.load_score() <= least + RESIDENT_SLACK]
    return close or serving


def adapter_cards(names: Iterable[str], parent: str, max_model_len: int) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the adapters (vLLM's shape: ``parent`` is the base)."""
    return [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "root": name,
            "parent": parent,
            "max_model_len": max_model_len,
        }
        for name in sorted(names)
    ]
