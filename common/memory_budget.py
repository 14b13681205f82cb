"""Memory promised at start against memory the machine has (docs/running.md "Memory";
issue #36): the KV cache (host memory on the CPU device; on CUDA it is sized from
``--gpu-memory-utilization``, a share of the GPU that cannot exceed it) and the host KV
tier (``--kv-offloading-size``, pinned memory on CUDA).

An engine that promises more than the machine holds used to start, report ready and fail
later (or end in an allocator traceback for ``64Ti``); ``pdserve up`` counts every engine
it starts on the machine, the engine itself checks its own share. Torch-free: the total
comes from ``/proc/meminfo`` and the cgroup's limit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# engine/config/engine.py's EngineConfig.kv_cache_memory when --kv-cache-memory is unset.
DEFAULT_CPU_KV_CACHE = 1 << 30


def host_memory_bytes() -> int | None:
    """The machine's memory (``MemTotal``; the cgroup's limit when lower), or None."""
    total: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        total = None
    limit = _cgroup_limit()
    if limit is not None and (total is None or limit < total):
        return limit
    return total


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):  # "max" / a huge number: no limit
            return int(text)
    return None


@dataclass(slots=True, frozen=True)
class EngineMemory:
    """What one engine promises: ``kv_cache`` (bytes; host memory on the cpu device, not
    counted on cuda) and ``host_tier`` (bytes of host memory, pinned on CUDA)."""

    device: str
    kv_cache: int = 0
    host_tier: int = 0

    def host_bytes(self) -> int:
        return self.host_tier + (self.kv_cache if self.device == "cpu" else 0)


def check_host(engines: list[EngineMemory], available: int | None, where: str) -> None:
    """ValueError naming the sizes when the engines' host memory exceeds ``available``."""
    if available is None or not engines:
        return
    total = sum(e.host_bytes() for e in engines)
    if total <= available:
        return
    parts = []
    kv = sum(e.kv_cache for e in engines if e.device == "cpu")
    tier = sum(e.host_tier for e in engines)
    if kv:
        parts.append(f"KV cache {_size(kv)} (--kv-cache-memory, CPU device)")
    if tier:
        pinned = " pinned" if any(e.device.startswith("cuda") for e in engines) else ""
        parts.append(f"host KV tier{pinned} {_size(tier)} (--kv-offloading-size)")
    count = f"{len(engines)} engines" if len(engines) > 1 else "the engine"
    raise ValueError(
        f"{count} would need {_size(total)} of host memory ({' + '.join(parts)}), "
        f"more than {where} has ({_size(available)}); lower the sizes or run fewer "
        "engines here"
    )


def _size(value: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value} bytes"
