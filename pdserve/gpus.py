"""GPU placement for `pdserve up`: which GPUs engines spread over (``--gpus N`` /
``--gpu-ids``), which engine gets which, and the share of GPU memory each may use.

Torch-free: it reads flags and ``CUDA_VISIBLE_DEVICES`` only (the model check of
``--tensor-parallel-size`` imports the engine's rule, only when N > 1).
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


def gpus_per_engine(args: argparse.Namespace) -> int:
    """P × N: one GPU per process of an engine's pipeline stages and tensor-parallel ranks."""
    tp = getattr(args, "tensor_parallel_size", None) or 1
    return int(tp) * int(getattr(args, "pipeline_parallel_size", None) or 1)


def assign_gpus(num_engines: int, ids: list[str] | None, per_engine: int = 1) -> list[str | None]:
    """GPUs of each engine, in launch order (prefill instances first, then decode), as its
    ``CUDA_VISIBLE_DEVICES``: with tensor and pipeline parallelism (``per_engine`` = P × N
    > 1) consecutive groups of P × N ids ("0,1", "2,3", ...; stage s's ranks are the s-th
    N of its group), round-robin over the groups; all None when engines are not pinned.
    LaunchError when ``ids`` cannot give one engine P × N GPUs."""
    if not ids:
        return [None] * num_engines
    if len(ids) < per_engine:
        raise LaunchError(
            f"--tensor-parallel-size x --pipeline-parallel-size = {per_engine} needs "
            f"{per_engine} GPUs per engine; --gpus / --gpu-ids give {len(ids)} ({','.join(ids)})"
        )
    groups = [
        ",".join(ids[k : k + per_engine]) for k in range(0, len(ids) - per_engine + 1, per_engine)
    ]
    return [groups[i % len(groups)] for i in range(num_engines)]


DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # the engine's own default


def gpu_share_flags(
    device: str, gpu: str | None, gpus: list[str | None], utilization: float | None = None
) -> list[str]:
    """``--gpu-memory-utilization`` for one engine: each engine sizes its KV cache as a
    fraction of its whole GPU, so engines sharing one GPU split ``utilization`` (the
    fraction of each GPU for all its engines; default 0.9) between them (unpinned engines
    all share the one default GPU)."""
    sharing = sum(1 for other in gpus if other == gpu)
    if device != "cuda" or (sharing < 2 and utilization is None):
        return []
    total = DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else utilization
    return ["--gpu-memory-utilization", f"{total / max(sharing, 1):.3f}"]


def check_tensor_parallel_size(model_dir: str, size: int) -> None:
    """``LaunchError`` when the model's heads (or KV heads, or intermediate size) cannot be
    split ``size`` ways: said once by ``pdserve up`` instead of by every engine's log. The
    rule is the engine's own (``engine/models/parallel.py``), imported only when N > 1."""
    if size <= 1:
        return
    from engine.config import EngineConfig
    from engine.models.config import ModelArgs
    from engine.models.parallel import check_tensor_parallel

    try:
        args = ModelArgs.from_hf(EngineConfig(model=model_dir).hf_config())
        check_tensor_parallel(args, size)
    except ValueError as exc:
        raise LaunchError(f"--tensor-parallel-size {size}: {exc}") from None


def check_parallel_sizes(model_dir: str, args: argparse.Namespace) -> None:
    """``LaunchError`` when the model cannot be split as ``--tensor-parallel-size`` and
    ``--pipeline-parallel-size`` ask (the engine's rules, said once by ``pdserve up``)."""
    check_tensor_parallel_size(model_dir, getattr(args, "tensor_parallel_size", None) or 1)
    size = getattr(args, "pipeline_parallel_size", None) or 1
    if size <= 1:
        return
    from engine.config import EngineConfig
    from engine.models.config import ModelArgs
    from engine.models.stages import check_pipeline_parallel

    try:
        args_ = ModelArgs.from_hf(EngineConfig(model=model_dir).hf_config())
        check_pipeline_parallel(args_.num_layers, size)
    except ValueError as exc:
        raise LaunchError(f"--pipeline-parallel-size {size}: {exc}") from None
