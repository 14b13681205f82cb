"""Model fingerprint: identifies KV compatibility across processes and machines.

It covers the model's config, the identity of its weights, the model dtype, the KV cache
dtype (when not the model's), the block size and the KV layout version; when above 1 the
tensor-parallel size ends it as ``-tp{N}`` and the pipeline-parallel size as ``-pp{P}``
before it (docs/design.md §3): a split, not another KV, so it is not hashed. A DeepSeek
model's (an MLA latent cache) carries ``-mla`` first, so a peer holding per-head K/V
names the kind when it refuses a handle (``kv_kind_of``). Weights are
identified by file names, sizes, the safetensors headers and a sample of tensor bytes
(hashing many GB at every start would be too slow). ``kv_layout`` is the other half of
compatibility: the shape of the blocks that records and handles carry.
"""

from __future__ import annotations

import hashlib
import json
import os

from engine.config import KV_LAYOUT_VERSION, EngineConfig
from engine.models import ModelArgs
from kv_store.base import KvLayout

_SAMPLE = 1 << 20


def model_fingerprint(config: EngineConfig) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(config.hf_config(), sort_keys=True, default=str).encode())
    h.update(f"|{config.torch_dtype_name}|{config.block_size}|v{KV_LAYOUT_VERSION}|".encode())
    mla = is_mla_config(config.hf_config())
    if config.kv_cache_dtype != "auto":
        # An fp8 cache's blocks are other bytes than the model dtype's: their store keys
        # must differ (auto keeps its old value, so existing records stay valid).
        h.update(f"kv:{config.kv_cache_dtype_name}|".encode())
    # The tensor- and pipeline-parallel sizes are not hashed: they only say how the blocks
    # are split over a grid's processes, which the suffix spells out, so two pools of one
    # model share the hash part and a decode of another split can re-cut the prefill's
    # blocks (``base_fingerprint``, engine/kv/reshard.py; docs/design.md §3 "KV between
    # unlike grids"). Store keys still differ per split: the suffix is part of them.
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if config.quantization:
        # Weights quantized at load compute other KV than the checkpoint's own precision.
        h.update(f"q:{config.quantization}|".encode())
        if config.fp8_scales != "channel":  # other scales, other KV (channel keeps its hash)
            h.update(f"s:{config.fp8_scales}|".encode())
    if config.load_format == "dummy":
        h.update(f"dummy:{config.seed}".encode())
    else:
        for name in sorted(os.listdir(config.model)):
            if name.endswith(".safetensors"):
                _hash_weights_file(h, os.path.join(config.model, name))
    # The sizes are also spelled out, so a refused handle can say which P and N it came from,
    # and an MLA latent cache's kind, so a K/V peer can say why it refuses one.
    return (
        h.hexdigest()[:32]
        + ("-mla" if mla else "")
        + (f"-pp{pp}" if pp > 1 else "")
        + (f"-tp{tp}" if tp > 1 else "")
    )


def kv_layout(config: EngineConfig, args: ModelArgs, num_kv_heads: int) -> KvLayout:
    """The shape of the engine process's KV blocks as records and handles carry it: the
    storage dtype (the KV cache's, not always the model's), ``num_kv_heads``, the heads
    this rank holds (all of them when N = 1), and the layers of stage 0, where the engine
    process runs (all of them when P = 1). A store or peer refuses blocks of another
    layout; the other processes of a grid take theirs from their own caches."""
    from engine.models.stages import Stage

    stage0 = Stage(0, config.pipeline_parallel_size, args.num_layers)
    return KvLayout(
        KV_LAYOUT_VERSION,
        config.kv_cache_dtype_name,
        config.block_size,
        len(stage0.layers),
        num_kv_heads,
        args.kv_head_dim,
        planes=args.kv_planes,
    )


def base_fingerprint(fingerprint: str) -> str:
    """The part of a fingerprint that names the model, dtypes, block size and layout: equal
    for two engines whose blocks hold the same KV, however each splits it over its grid."""
    return fingerprint.split("-", 1)[0]


def is_mla_config(cfg: dict[str, object]) -> bool:
    """Whether a config.json's model caches MLA latents (DeepSeek-V2/V3)."""
    from engine.models.deepseek_args import DEEPSEEK_ARCHITECTURES

    archs = cfg.get("architectures")
    return isinstance(archs, list) and bool(archs) and archs[0] in DEEPSEEK_ARCHITECTURES


def kv_kind_of(fingerprint: str) -> str:
    """What a fingerprint's blocks hold: "MLA latent" (``-mla``) or "per-head K/V"."""
    return "MLA latent" if "mla" in fingerprint.split("-")[1:] else "per-head K/V"


def tensor_parallel_size_of(fingerprint: str) -> int:
    """The ``tensor_parallel_size`` a fingerprint was made for (1 without a ``-tp`` suffix)."""
    return _size_of(fingerprint, "tp")


def pipeline_parallel_size_of(fingerprint: str) -> int:
    """The ``pipeline_parallel_size`` a fingerprint was made for (1 without ``-pp``)."""
    return _size_of(fingerprint, "pp")


def _size_of(fingerprint: str, kind: str) -> int:
    for part in fingerprint.split("-")[1:]:
        if part.startswith(kind) and part[2:].isdigit():
            return int(part[2:])
    return 1


def _hash_weights_file(h: hashlib._Hash, path: str) -> None:
    size = os.path.getsize(path)
    h.update(f"{os.path.basename(path)}:{size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(_SAMPLE))
        if size > 2 * _SAMPLE:
            f.seek(size - _SAMPLE)
            h.update(f.read(_SAMPLE))
