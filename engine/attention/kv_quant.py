"""The paged KV cache's storage dtype and its FP8 (e4m3) quantization (docs/design.md §3,
"KV cache dtype").

``kv_cache_dtype`` "auto" stores K and V in the model dtype. "fp8" stores
``torch.float8_e4m3fn`` with one float32 scale per tensor (K and V of a layer): a value
``x`` is stored as ``fp8(clamp(x / scale, ±448))`` and read back as ``float(q) * scale``.
The scale is 1.0 (``DEFAULT_SCALE``), what vLLM uses when a checkpoint carries no calibrated
scale: post-RoPE keys and values of Llama-family models sit well inside e4m3's range
(2**-9 .. 448), and a fixed scale keeps a block's bytes a plain e4m3 tensor, so records,
p2p copies and prefix-cache blocks stay interchangeable between instances with no scale
to ship beside them. The kernels take ``k_scale``/``v_scale`` anyway (tests run them at
other values), so calibrated per-layer scales need no kernel change.

Torch's CPU build has no ``index_copy_`` for float8 and gloo cannot send it: code that
only moves cache bytes goes through ``byte_view``.
"""

from __future__ import annotations

import torch

# The cache-byte view is part of the KV connector interface (kv_store must not import the
# engine, and the engine imports no other kv_store module).
from kv_store.base import byte_view  # noqa: F401  (re-exported for the engine)

KV_CACHE_DTYPES = ("auto", "fp8")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value; stores saturate there (never NaN)
DEFAULT_SCALE = 1.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as the cache stores it: a plain cast for a model-dtype cache, else
    ``x / scale`` clamped to ±448 and rounded to e4m3 (round to nearest even)."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    y = x.float()
    if scale != 1.0:
        y = y / scale
    return y.clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache values ``x`` as ``dtype`` (times ``scale`` for an fp8 cache)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    y = x.float()
    if scale != 1.0:
        y = y * scale
    return y.to(dtype)
