"""Which adapters the engine knows, which sit in host memory, and which hold a GPU slot
(docs/lora.md). Policy lives here; the stacks themselves belong to ``LoRASlots``.

* registry: name -> path of every adapter the engine may serve (``--lora-modules`` and
  runtime loads); a request naming anything else is refused at once;
* host cache: up to ``max_cpu_loras`` checked adapters (LRU), so swapping one back into a
  slot costs a copy, not a read and a check;
* slots: ``max_loras`` GPU slots. A slot used by a running request is pinned (reference
  count); an idle slot keeps its adapter until the least recently used one is needed.
  A request whose adapter can get no slot stays waiting (others pass it) until its
  deadline, then fails with ``LoRASlotTimeout`` (503 + Retry-After at the router).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from common.block_hash import ROOT_PARENT, adapter_root
from engine.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from engine.lora.request import SLOT_TIMEOUT_ERROR

__all__ = ["SLOT_TIMEOUT_ERROR", "AdapterInfo", "LoRAManager", "LoRAStats"]
from engine.lora.slots import LoRASlots
from engine.models.config import ModelArgs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoRAStats:
    loads: int = 0  # adapters copied into a slot
    evictions: int = 0  # adapters replaced in a slot by another
    slot_timeouts: int = 0  # requests failed after waiting for a slot


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    name: str
    path: str
    identity: str  # name:content hash (what the KV keys carry)


class LoRAManager:
    def __init__(
        self,
        args: ModelArgs,
        slots: LoRASlots,
        max_rank: int,
        max_cpu_loras: int,
        wait_timeout: float,
    ) -> None:
        self.args, self.slots, self.max_rank = args, slots, max_rank
        self.max_cpu_loras, self.wait_timeout = max_cpu_loras, wait_timeout
        self.registry: dict[str, AdapterInfo] = {}
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._slot_name: list[str | None] = [None] * slots.max_loras
        self._slot_identity: list[str | None] = [None] * slots.max_loras
        self._refs = [0] * slots.max_loras
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident, unused; LRU first
        self.stats = LoRAStats()
        # Runtime loads and unloads come from the service's thread while the engine thread
        # acquires and releases slots: every method that reads or changes state holds it.
        self._lock = threading.RLock()

    # -- registry -------------------------------------------------------------------------
    def add(self, name: str, path: str) -> AdapterInfo:
        """Check and register an adapter (``LoRAError`` says what is wrong with it)."""
        if not name or name.split() != [name]:
            raise LoRAError(f"LoRA adapter name {name!r} must be non-empty, without spaces")
        if name in self.registry:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded")
        adapter = load_adapter(name, path, self.args, self.max_rank)  # outside the lock: slow
        info = AdapterInfo(name, adapter.path, adapter.identity)
        with self._lock:
            if name in self.registry:
                raise LoRAError(f"LoRA adapter {name!r} is already loaded")
            self.registry[name] = info
            self._cache(adapter)
        logger.info("LoRA adapter %s registered from %s (rank %d)", name, path, adapter.rank)
        return info

    def remove(self, name: str) -> None:
        """Forget an adapter; running requests finish with it, new ones are refused."""
        with self._lock:
            if self.registry.pop(name, None) is None:
                raise LoRAError(f"LoRA adapter {name!r} is not loaded")
            self._host.pop(name, None)
            for slot, held in enumerate(self._slot_name):
                if held == name and self._refs[slot] == 0:
                    self._clear(slot)

    def resolve(self, name: str) -> AdapterInfo:
        info = self.registry.get(name)
        if info is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        return info

    def hash_root(self, name: str | None) -> bytes:
        return ROOT_PARENT if name is None else adapter_root(self.resolve(name).identity)

    @property
    def resident(self) -> list[str]:
        return [n for n in self._slot_name if n is not None]

    @property
    def num_in_use(self) -> int:
        return sum(1 for r in self._refs if r > 0)

    # -- slots ----------------------------------------------------------------------------
    def acquire(self, name: str, identity: str) -> int | None:
        """A slot holding adapter ``identity``, pinned for one more request; None when every
        slot is pinned by other adapters (the caller keeps the request waiting)."""
        with self._lock:
            return self._acquire(name, identity)

    def _acquire(self, name: str, identity: str) -> int | None:
        for slot, held in enumerate(self._slot_identity):
            if held == identity:
                self._pin(slot)
                return slot
        free = [s for s, held in enumerate(self._slot_name) if held is None]
        if free:
            slot = free[0]
        elif self._idle:
            slot = next(iter(self._idle))
            self.stats.evictions += 1
            logger.info("LoRA slot %d: evicting %s for %s", slot, self._slot_name[slot], name)
        else:
            return None
        try:
            adapter = self._host_copy(name)
        except LoRAError as exc:  # its files changed or went away since it was checked
            logger.warning("LoRA adapter %s cannot be reloaded: %s", name, exc)
            return None
        if adapter.identity != identity:  # the adapter was replaced since the request came
            return None
        self.slots.load(slot, adapter)
        self.stats.loads += 1
        self._slot_name[slot], self._slot_identity[slot] = name, identity
        self._pin(slot)
        return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self._release(slot)

    def _release(self, slot: int) -> None:
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            if self._slot_name[slot] not in self.registry:  # unloaded while in use
                self._clear(slot)
            else:
                self._idle[slot] = None

    def deadline(self) -> float:
        return time.monotonic() + self.wait_timeout

    def _pin(self, slot: int) -> None:
        self._refs[slot] += 1
        self._idle.pop(slot, None)

    def _clear(self, slot: int) -> None:
        self._slot_name[slot] = self._slot_identity[slot] = None
        self._idle.pop(slot, None)

    def _host_copy(self, name: str) -> LoRAAdapter:
        adapter = self._host.get(name)
        if adapter is not None:
            self._host.move_to_end(name)
            return adapter
        adapter = load_adapter(name, self.resolve(name).path, self.args, self.max_rank)
        self._cache(adapter)
        return adapter

    def _cache(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
