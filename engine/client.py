"""The engine's seam to the services (docs/design.md §2): one request type and the
``EngineClient`` protocol that ``AsyncLLMEngine`` implements.

The services call the engine only through ``EngineClient``; everything a request carries
travels in one ``GenerateRequest`` instead of keyword dicts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.outputs import RequestOutput
    from engine.core.request import RemoteKV
    from engine.core.sampling_params import SamplingParams
    from engine.stats import EngineStats, LoadStats
    from kv_store.base import KvLayout


@dataclass(slots=True)
class GenerateRequest:
    """One request for the engine.

    ``output_token_ids`` are tokens already generated elsewhere (the first token from
    prefill, or a resumed stream's tokens); they count toward ``params.max_tokens`` and are
    never emitted again. ``remote_kv`` says where the prompt's KV waits (decode side);
    ``save_kv`` asks the engine to hand the prompt's KV to the connector (prefill side).
    ``lora_name`` names the LoRA adapter to run with (None: the base model; docs/lora.md).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] | None = None
    remote_kv: RemoteKV | None = None
    save_kv: bool = False
    priority: int = 0
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class LoRAView:
    """The LoRA adapters an engine serves (name -> identity, the name:content hash its KV
    keys carry) and those in a slot now, as the services read them (docs/lora.md)."""

    identities: dict[str, str]
    resident: tuple[str, ...]

    def identity(self, name: str) -> str:
        """``ValueError`` when this engine does not serve ``name``."""
        try:
            return self.identities[name]
        except KeyError:
            raise ValueError(f"LoRA adapter {name!r} is not loaded") from None


class EngineClient(Protocol):
    """What a service needs from a running engine (``AsyncLLMEngine``)."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def model_fingerprint(self) -> str: ...

    @property
    def kv_layout(self) -> KvLayout: ...

    @property
    def max_model_len(self) -> int: ...

    async def start(self) -> None: ...

    async def shutdown(self, timeout: float = 10.0) -> None: ...

    def submit(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's output deltas; ``ValueError`` for bad input; leaving the
        iteration early aborts the request."""
        ...

    async def abort(self, request_id: str) -> bool: ...

    def get_load(self) -> LoadStats: ...

    def lora_view(self) -> LoRAView | None:
        """The adapters served now; None when LoRA is off."""
        ...

    async def load_lora_adapter(self, name: str, path: str) -> list[str]: ...

    async def unload_lora_adapter(self, name: str) -> list[str]: ...

    def stats(self) -> EngineStats: ...

    @property
    def fatal_error(self) -> BaseException | None:
        """Why the engine died for good (a tensor-parallel rank failed), else None."""
        ...
