"""Per-pool tensor- and pipeline-parallel sizes for `pdserve up` (issue 38): the prefill
and decode pools may be split differently (``--prefill-tensor-parallel-size``,
``--decode-tensor-parallel-size`` and the pipeline twins; unset: the shared
``--tensor-parallel-size`` / ``--pipeline-parallel-size``). The decode re-cuts the
prefill's KV (docs/design.md §3 "KV between unlike grids").

Torch-free; the model checks import the engine's rules only when a size is above 1.
"""

from __future__ import annotations

import argparse

from pdserve.gpus import check_parallel_sizes
from pdserve.procs import LaunchError

ROLES = ("prefill", "decode")


def pool_sizes(args: argparse.Namespace, role: str) -> tuple[int, int]:
    """``(pipeline_parallel_size, tensor_parallel_size)`` of one pool's engines."""
    pp = getattr(args, f"{role}_pipeline_parallel_size", None)
    tp = getattr(args, f"{role}_tensor_parallel_size", None)
    shared_pp = getattr(args, "pipeline_parallel_size", None) or 1
    shared_tp = getattr(args, "tensor_parallel_size", None) or 1
    return int(pp or shared_pp), int(tp or shared_tp)


SIZE_FLAGS = ("--tensor-parallel-size", "--pipeline-parallel-size")


def pool_flags(engine_flags: list[str], args: argparse.Namespace, role: str) -> list[str]:
    """``engine_flags`` (every engine's) with one pool's own sizes in place of the shared
    ones: each size flag once, and only when above 1 or given."""
    out, skip = [], False
    for word in engine_flags:
        if skip:
            skip = False
        elif word in SIZE_FLAGS:
            skip = True  # its value follows
        else:
            out.append(word)
    pp, tp = pool_sizes(args, role)
    if tp > 1 or getattr(args, "tensor_parallel_size", None):
        out += ["--tensor-parallel-size", str(tp)]
    if pp > 1 or getattr(args, "pipeline_parallel_size", None):
        out += ["--pipeline-parallel-size", str(pp)]
    return out


def engine_sizes(args: argparse.Namespace) -> list[int]:
    """P x N of every engine in launch order (prefill instances, then decode)."""
    sizes = []
    for role, count in (("prefill", args.prefill or 0), ("decode", args.decode)):
        pp, tp = pool_sizes(args, role)
        sizes += [pp * tp] * count
    return sizes


def assign_gpu_groups(sizes: list[int], ids: list[str] | None) -> list[str | None]:
    """Each engine's ``CUDA_VISIBLE_DEVICES``: the next ``sizes[i]`` consecutive ids,
    starting over from the first when the rest are too few (engines then share GPUs);
    all None when engines are not pinned. LaunchError when one engine needs more GPUs
    than ``ids`` has."""
    if not ids:
        return [None] * len(sizes)
    out: list[str | None] = []
    cursor = 0
    for size in sizes:
        if size > len(ids):
            raise LaunchError(
                f"an engine of {size} processes (pipeline x tensor parallel) needs {size} "
                f"GPUs; --gpus / --gpu-ids give {len(ids)} ({','.join(ids)})"
            )
        if cursor + size > len(ids):
            cursor = 0
        out.append(",".join(ids[cursor : cursor + size]))
        cursor += size
    return out


def check_pool_sizes(model_dir: str, args: argparse.Namespace) -> None:
    """LaunchError naming the pool when the model cannot be split as it asks."""
    for role in ROLES:
        pp, tp = pool_sizes(args, role)
        sized = argparse.Namespace(pipeline_parallel_size=pp, tensor_parallel_size=tp)
        try:
            check_parallel_sizes(model_dir, sized)
        except LaunchError as exc:
            raise LaunchError(f"{role} pool: {exc}") from None


def uneven(args: argparse.Namespace) -> bool:
    """Whether the two pools are split differently."""
    return pool_sizes(args, "prefill") != pool_sizes(args, "decode")
