"""CUDA IPC between two processes on one GPU: the decode side maps the prefill side's paged
cache and copies the leased blocks device to device itself (docs/design.md §3, "p2p").

NCCL refuses two ranks on one GPU, so without this a prefill and a decode instance that
share a GPU would stage every block through host memory (gloo). With it the handoff is one
gather and one scatter on the GPU (``index_select`` + ``index_copy_``), at device-memory
bandwidth.

The cache's IPC description travels as plain JSON fields (handle bytes base64-encoded),
never pickled: a peer's message must not be able to run code here. Only a cache allocation
of the same GPU (matched by UUID before this is used) is opened.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from kv_store.base import byte_view

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode("ascii")


def _unb64(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value.encode("ascii"), validate=True)


def describe_cache(kv: torch.Tensor) -> dict[str, Any]:
    """The IPC description of a CUDA cache tensor, as JSON-safe fields."""
    if kv.device.type != "cuda":
        raise ValueError("CUDA IPC needs a CUDA cache")
    dtype = str(kv.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"CUDA IPC: unsupported cache dtype {dtype}")
    storage = kv.untyped_storage()
    (
        _device,
        handle,
        size_bytes,
        offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return {
        "shape": list(kv.shape),
        "stride": list(kv.stride()),
        "offset": kv.storage_offset(),
        "dtype": dtype,
        "handle": _b64(handle),
        "size_bytes": int(size_bytes),
        "offset_bytes": int(offset_bytes),
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": _b64(event_handle),
        "event_sync_required": bool(event_sync_required),
    }


def open_cache(desc: dict[str, Any], device: torch.device) -> torch.Tensor:
    """Map the peer's cache described by ``describe_cache`` (same GPU) as a tensor.

    Raises ``ValueError`` for a malformed description, ``RuntimeError`` when the driver
    refuses the handle.
    """
    try:
        dtype = _DTYPES[str(desc["dtype"])]
        shape = [int(x) for x in desc["shape"]]
        stride = [int(x) for x in desc["stride"]]
        offset = int(desc["offset"])
        handle = _unb64(desc["handle"])
        ref_handle = _unb64(desc["ref_counter_handle"])
        event_handle = _unb64(desc["event_handle"])
        size_bytes, offset_bytes = int(desc["size_bytes"]), int(desc["offset_bytes"])
        ref_offset, event_sync = int(desc["ref_counter_offset"]), bool(desc["event_sync_required"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"bad CUDA IPC cache description: {e}") from None
    if len(shape) != 6 or len(stride) != 6 or handle is None:
        raise ValueError("bad CUDA IPC cache description: expected a 6-d cache and a handle")
    index = device.index if device.index is not None else torch.cuda.current_device()
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        handle,
        size_bytes,
        offset_bytes,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    )
    itemsize = torch.empty((), dtype=dtype).element_size()
    needed = offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1
    if needed * itemsize > storage.nbytes():
        raise ValueError("bad CUDA IPC cache description: the view exceeds the allocation")
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)


def fusable(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether the one-launch Triton copy applies: contiguous caches of one dtype and block
    shape (the planes of ``[layers, 2]`` then sit ``stride(1)`` apart)."""
    return (
        src.is_contiguous()
        and dst.is_contiguous()
        and src.dtype == dst.dtype
        and src.shape[:2] == dst.shape[:2]
        and src.shape[3:] == dst.shape[3:]
    )


def copy_blocks(
    src: torch.Tensor,
    src_ids: list[int],
    dst: torch.Tensor,
    dst_ids: list[int],
    stream: torch.cuda.Stream,
    batch_blocks: int,
) -> None:
    """Copy blocks ``src[:, :, src_ids]`` into ``dst[:, :, dst_ids]`` on ``stream`` and wait
    for the copy. One Triton launch reading and writing each block once where it applies;
    otherwise ``index_select`` + ``index_copy_`` in batches of ``batch_blocks`` (bounding
    the temporary)."""
    if len(src_ids) != len(dst_ids):
        raise ValueError("copy_blocks: source and destination block counts differ")
    if not src_ids:
        return
    src, dst = byte_view(src), byte_view(dst)  # fp8 caches: plain bytes (kv_quant.byte_view)
    with torch.cuda.stream(stream):
        if fusable(src, dst):
            from kv_store.p2p.block_copy import copy_blocks_triton

            ids = torch.tensor([src_ids, dst_ids], dtype=torch.int64).pin_memory()
            ids = ids.to(dst.device, non_blocking=True)
            copy_blocks_triton(src, ids[0], dst, ids[1])
        else:
            for i in range(0, len(src_ids), batch_blocks):
                s = torch.tensor(src_ids[i : i + batch_blocks], device=src.device)
                d = torch.tensor(dst_ids[i : i + batch_blocks], device=dst.device)
                dst.index_copy_(2, d, src.index_select(2, s))
    stream.synchronize()
