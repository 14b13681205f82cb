"""pdserve's inference engine: paged KV cache, continuous batching, chunked prefill,
prefix caching. No networking here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.sampling_params import SamplingParams
from engine.lora.request import LoRARequest

if TYPE_CHECKING:
    from engine.llm import LLM

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str) -> object:
    # LLM pulls in torch; keep `import common.block_hash` light for the router.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
