"""GPU placement for `pdserve up`: which GPUs engines spread over (``--gpus N`` /
``--gpu-ids``), which engine gets which, and the share of GPU memory each may use.

Torch-free: it reads flags and ``CUDA_VISIBLE_DEVICES`` only.
"""

from __future__ import annotations

import argparse
import os

from pdserve.procs import LaunchError


def gpu_ids(args: argparse.Namespace, environ: dict[str, str] | None = None) -> list[str] | None:
    """The GPUs to spread engines over (``--gpu-ids``, or the first ``--gpus`` of the visible
    ones), or None when engines are not pinned. LaunchError on misuse."""
    gpus: int | None = getattr(args, "gpus", None)
    ids: str | None = getattr(args, "gpu_ids", None)
    if gpus is None and ids is None:
        return None
    if gpus is not None and ids is not None:
        raise LaunchError("give --gpus N or --gpu-ids LIST, not both")
    if args.device != "cuda":
        raise LaunchError("--gpus / --gpu-ids need --device cuda")
    if ids is not None:
        chosen = [part.strip() for part in ids.split(",") if part.strip()]
        if not chosen or len(set(chosen)) != len(chosen):
            raise LaunchError(f"--gpu-ids must list distinct GPU ids, got {ids!r}")
        return chosen
    count = int(gpus or 0)
    # --gpus N counts from what this process may see, so an outer CUDA_VISIBLE_DEVICES holds.
    visible = (environ if environ is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    pool = [p.strip() for p in visible.split(",") if p.strip()] if visible else None
    if pool is not None and len(pool) < count:
        raise LaunchError(f"--gpus {count} but CUDA_VISIBLE_DEVICES={visible!r} lists fewer")
    return (pool or [str(i) for i in range(count)])[:count]


def assign_gpus(num_engines: int, ids: list[str] | None) -> list[str | None]:
    """GPU of each engine, in launch order (prefill instances first, then decode):
    round-robin over ``ids``; all None when engines are not pinned."""
    if not ids:
        return [None] * num_engines
    return [ids[i % len(ids)] for i in range(num_engines)]


def gpu_share_flags(device: str, gpu: str | None, gpus: list[str | None]) -> list[str]:
    """``--gpu-memory-utilization`` for one engine: each engine sizes its KV cache as a
    fraction of its whole GPU, so engines sharing one GPU split the usual 0.9 between them
    (unpinned engines all share the one default GPU)."""
    sharing = sum(1 for other in gpus if other == gpu)
    if device != "cuda" or sharing < 2:
        return []
    return ["--gpu-memory-utilization", f"{0.9 / sharing:.3f}"]
