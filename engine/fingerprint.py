"""Model fingerprint: identifies KV compatibility across processes and machines.

It covers the model's config, the identity of its weights, the model dtype, the KV cache
dtype (when not the model's), the block size, the KV layout version and (when above 1) the
tensor-parallel size, which also ends it as ``-tp{N}`` (docs/design.md §3). Weights are
identified by file names, sizes, the safetensors headers and a sample of tensor bytes
(hashing many GB at every start would be too slow).
"""

from __future__ import annotations

import hashlib
import json
import os

from engine.config import KV_LAYOUT_VERSION, EngineConfig

_SAMPLE = 1 << 20


def model_fingerprint(config: EngineConfig) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(config.hf_config(), sort_keys=True, default=str).encode())
    h.update(f"|{config.torch_dtype_name}|{config.block_size}|v{KV_LAYOUT_VERSION}|".encode())
    if config.kv_cache_dtype != "auto":
        # An fp8 cache's blocks are other bytes than the model dtype's: their store keys
        # must differ (auto keeps its old value, so existing records stay valid).
        h.update(f"kv:{config.kv_cache_dtype_name}|".encode())
    tp = config.tensor_parallel_size
    if tp > 1:
        # Each rank's cache holds only its KV heads: blocks of another split are not
        # interchangeable, so a handle from it must not match (N = 1 keeps its old value).
        h.update(f"tp{tp}|".encode())
    if config.quantization:
        # Weights quantized at load compute other KV than the checkpoint's own precision.
        h.update(f"q:{config.quantization}|".encode())
    if config.load_format == "dummy":
        h.update(f"dummy:{config.seed}".encode())
    else:
        for name in sorted(os.listdir(config.model)):
            if name.endswith(".safetensors"):
                _hash_weights_file(h, os.path.join(config.model, name))
    # The size is also spelled out, so a refused handle can say which N it came from.
    return h.hexdigest()[:32] + (f"-tp{tp}" if tp > 1 else "")


def tensor_parallel_size_of(fingerprint: str) -> int:
    """The ``tensor_parallel_size`` a fingerprint was made for (1 without a ``-tp`` suffix)."""
    _, sep, tail = fingerprint.rpartition("-tp")
    return int(tail) if sep and tail.isdigit() else 1


def _hash_weights_file(h: hashlib._Hash, path: str) -> None:
    size = os.path.getsize(path)
    h.update(f"{os.path.basename(path)}:{size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(_SAMPLE))
        if size > 2 * _SAMPLE:
            f.seek(size - _SAMPLE)
            h.update(f.read(_SAMPLE))
