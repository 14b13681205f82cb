"""The engine's LoRA glue (docs/lora.md): builds the slots and the manager from the
config, binds requests to adapters, finds requests that waited too long for a slot, and
turns the offline API's ``LoRARequest`` into adapter names. ``LLMEngine`` holds one
``LoRAServing`` when ``enable_lora`` is set. A top-level module: it reaches the runner,
the scheduler and the engine, above ``engine/lora/`` (docs/design.md §2)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.client import LoRAView
from engine.lora.adapter import LoRAError
from engine.lora.manager import AdapterInfo, LoRAManager
from engine.lora.request import LoRARequest
from engine.lora.slots import LoRASlots

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.request import Request
    from engine.core.scheduler import Scheduler
    from engine.executor.model_runner import ModelRunner
    from engine.models.config import ModelArgs


class LoRAServing:
    def __init__(self, config: EngineConfig, args: ModelArgs, runner: ModelRunner) -> None:
        self.slots = LoRASlots(
            args, config.max_loras, config.max_lora_rank, runner.dtype, config.device,
            max_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
        )  # fmt: skip
        runner.bind_lora(self.slots)  # the layers, and CUDA graphs with the LoRA kernels
        self.manager = LoRAManager(
            args,
            self.slots,
            config.max_lora_rank,
            config.max_cpu_loras or config.max_loras,
            config.lora_wait_timeout,
        )
        for name, path in config.lora_modules:
            self.manager.add(name, path)
        self.waiting_for_slot = 0  # as of the last step

    def add_adapter(self, name: str, path: str) -> AdapterInfo:
        return self.manager.add(name, path)

    def remove_adapter(self, name: str) -> None:
        self.manager.remove(name)

    def bind(self, request: Request, name: str) -> None:
        """Make ``request`` run with adapter ``name``: its identity, its KV hash chain's
        root, its deadline for a slot. ``LoRAError`` for an unknown adapter."""
        info = self.manager.resolve(name)
        request.lora_name, request.lora_identity = name, info.identity
        request.hash_root = self.manager.hash_root(name)
        request.lora_deadline = self.manager.deadline()

    def expired(self, scheduler: Scheduler) -> list[Request]:
        """Waiting requests past their deadline for a slot (to be failed); also counts
        those waiting for one (``waiting_for_slot``, read by the metrics)."""
        now = time.monotonic()
        wanting = [r for r in scheduler.waiting if r.lora_name is not None and r.lora_slot < 0]
        late = [r for r in wanting if r.lora_deadline < now]
        self.waiting_for_slot = len(wanting) - len(late)
        self.manager.stats.slot_timeouts += len(late)
        return late

    def num_waiting_for_slot(self, scheduler: Scheduler) -> int:
        return sum(1 for r in scheduler.waiting if r.lora_name is not None and r.lora_slot < 0)

    def metrics(self) -> dict[str, float]:
        """The numbers the service exports (service/metrics.py); any thread."""
        stats = self.manager.stats
        return {
            "loads": stats.loads,
            "evictions": stats.evictions,
            "slot_timeouts": stats.slot_timeouts,
            "resident_adapters": len(self.manager.resident),
            "registered_adapters": len(self.manager.registry),
            "waiting_for_slot": self.waiting_for_slot,
        }


def bind_lora(serving: LoRAServing | None, request: Request, name: str | None) -> None:
    """``LoRAServing.bind``, or a clear error when the engine serves no adapters."""
    if name is None:
        return
    if serving is None:
        raise LoRAError(f"LoRA adapter {name!r} requested but LoRA is not enabled")
    serving.bind(request, name)


def lora_names(
    serving: LoRAServing | None, lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[str | None]:
    """The adapter name of each of ``n`` prompts, registering adapters the engine does not
    know yet (``ValueError`` for a bad adapter, or one name given two paths)."""
    if lora is None or isinstance(lora, LoRARequest):
        per_prompt: list[LoRARequest | None] = [lora] * n
    else:
        per_prompt = list(lora)
        if len(per_prompt) != n:
            raise ValueError(f"got {len(per_prompt)} LoRA requests for {n} prompts")
    names: list[str | None] = []
    for req in per_prompt:
        if req is None:
            names.append(None)
            continue
        if serving is None:
            raise ValueError("lora_request needs an engine built with enable_lora=True")
        known = serving.manager.registry.get(req.lora_name)
        if known is None:
            if not req.lora_path:
                raise ValueError(f"LoRA adapter {req.lora_name!r} is not loaded and has no path")
            serving.add_adapter(req.lora_name, req.lora_path)
        elif req.lora_path and os.path.abspath(req.lora_path) != known.path:
            raise ValueError(
                f"LoRA adapter {req.lora_name!r} is loaded from {known.path!r}, not "
                f"{req.lora_path!r}"
            )
        names.append(req.lora_name)
    return names


LORA_OFF = "LoRA is not enabled on this instance (start it with --enable-lora)"


def add_adapter(lora: LoRAServing | None, name: str, path: str) -> list[str]:
    """A runtime ``load_lora_adapter`` (both engine clients): ``ValueError`` when LoRA is
    off or the adapter is bad; the adapters served now."""
    if lora is None:
        raise ValueError(LORA_OFF)
    lora.add_adapter(name, path)
    return sorted(lora.manager.registry)


def remove_adapter(lora: LoRAServing | None, name: str) -> list[str]:
    """A runtime ``unload_lora_adapter`` (running requests finish with it)."""
    if lora is None:
        raise ValueError(LORA_OFF)
    lora.remove_adapter(name)
    return sorted(lora.manager.registry)


def lora_view(lora: LoRAServing | None) -> LoRAView | None:
    """What the services read of ``lora`` (None when LoRA is off)."""
    if lora is None:
        return None
    mgr = lora.manager
    identities = {name: info.identity for name, info in sorted(mgr.registry.items())}
    return LoRAView(identities, tuple(mgr.resident))
