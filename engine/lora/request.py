"""``LoRARequest``: which adapter a request runs with, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass

# The error of a request that waited past its deadline for a LoRA slot; the services
# answer it RESOURCE_EXHAUSTED, the router 503 with Retry-After (docs/lora.md).
SLOT_TIMEOUT_ERROR = "no LoRA slot became free before the request's deadline"


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``: the engine registers
    ``lora_path`` under ``lora_name`` the first time it sees the name. ``lora_int_id`` is
    accepted for compatibility; the name identifies the adapter here."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
