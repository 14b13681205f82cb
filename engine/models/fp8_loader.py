"""Which FP8 scheme a model runs with, from ``EngineConfig.quantization`` and the
checkpoint's ``config.json`` (docs/quantization.md, docs/design.md §3).

Two sources of FP8 weights, one in-memory layout (``engine/models/fp8.py``): e4m3 weights
``[N, K]`` with one float32 scale per output channel, activations scaled per token at run
time.

* ``quantization="fp8"`` on a bf16/fp16/fp32 checkpoint: quantized at load.
* A compressed-tensors "float-quantized" checkpoint (the ``*-FP8`` / ``*-FP8-dynamic``
  Llama models): its ``quantization_config`` is read here; per-channel or per-tensor weight
  scales both become per-channel (a per-tensor scale repeats over its rows, which is exact).

``fp8_scales="tensor"`` (``Fp8Scheme.tensor_scales``): one weight scale per (fused) tensor
and one dynamic activation scale per step, vLLM's default for ``--quantization fp8``.
Quantized at load, or a checkpoint with ``strategy: tensor`` weights (its fused parts
requantized to the largest of their scales); a per-channel checkpoint keeps its channel
scales (requantizing them per tensor would only lose precision).

Torch-free: ``EngineConfig.validate`` calls ``resolve_quantization`` before anything loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from engine.models.config import ModelArgs

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("fp8",)
# What a compressed-tensors checkpoint may leave unquantized: the vocab projections, which
# this engine keeps in the model dtype anyway.
_IGNORABLE = ("lm_head", "re:.*lm_head", "model.embed_tokens", "re:.*embed_tokens")
_WEIGHT_STRATEGIES = ("channel", "tensor")
FP8_SCALES = ("channel", "tensor")  # EngineConfig.fp8_scales


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """``from_checkpoint``: the weights on disk are already e4m3 with ``weight_scale``
    tensors (else they are quantized at load). ``static_input_scales``: the checkpoint
    carries per-tensor ``input_scale`` tensors, which are skipped: activations are always
    scaled per token at run time (at least as accurate as one calibrated scale), or per
    tensor dynamically with ``tensor_scales``."""

    from_checkpoint: bool
    static_input_scales: bool = False
    # Per-tensor weight and activation scales (fp8_scales="tensor"; engine/models/fp8.py).
    tensor_scales: bool = False


def resolve_quantization(
    requested: str | None, hf_config: dict[str, Any], scales: str = "channel"
) -> Fp8Scheme | None:
    """The scheme for ``requested`` (None or "fp8") and a checkpoint whose config.json is
    ``hf_config``; None means unquantized. ``scales``: ``EngineConfig.fp8_scales``.
    ``ValueError`` (saying what is supported) for an unknown ``requested`` or ``scales``, or
    a checkpoint quantization this engine does not run."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or unset, got {requested!r}")
    if scales not in FP8_SCALES:
        raise ValueError(f"fp8_scales must be one of {FP8_SCALES}, got {scales!r}")
    qcfg = hf_config.get("quantization_config")
    if isinstance(qcfg, dict) and qcfg.get("quant_method") == "mxfp4":
        archs = hf_config.get("architectures") or []
        if archs != ["GptOssForCausalLM"]:
            raise ValueError(f"MXFP4 checkpoints are supported for gpt-oss only, not {archs}")
        # Its experts are dequantized at load (engine/models/gpt_oss.py): unquantized
        # from here on, or FP8 when asked.
        qcfg = None
    if not qcfg:
        if requested != "fp8":
            return None
        return Fp8Scheme(from_checkpoint=False, tensor_scales=scales == "tensor")
    return _parse_compressed_tensors(qcfg, scales)


def _parse_compressed_tensors(qcfg: Any, scales: str) -> Fp8Scheme:
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    fmt = qcfg.get("format") if isinstance(qcfg, dict) else None
    if method != "compressed-tensors" or fmt != "float-quantized":
        raise ValueError(
            f"checkpoint quantization (quant_method {method!r}, format {fmt!r}) is not "
            "supported; this engine loads compressed-tensors 'float-quantized' FP8 "
            "checkpoints, or quantizes an unquantized checkpoint with quantization='fp8'"
        )
    groups = qcfg.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(
            f"compressed-tensors checkpoint has {len(groups)} config_groups; only one group "
            "(every decoder Linear quantized alike) is supported"
        )
    group = next(iter(groups.values()))
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise ValueError(
            f"compressed-tensors targets {targets!r} are not supported; need ['Linear']"
        )
    weights = group.get("weights") or {}
    _check_weights(weights)
    static = _check_activations(group.get("input_activations"))
    ignored = [name for name in qcfg.get("ignore") or [] if name not in _IGNORABLE]
    if ignored:
        raise ValueError(
            f"compressed-tensors checkpoint leaves {ignored[:3]} unquantized; only lm_head "
            "and the embedding may be left out (mixed-precision layers are not supported)"
        )
    if static:
        logger.info("FP8 checkpoint has static input scales: using per-token scales instead")
    tensor = scales == "tensor" and weights.get("strategy") == "tensor"
    if scales == "tensor" and not tensor:
        logger.info("fp8_scales=tensor: this checkpoint's weights are per channel; kept so")
    return Fp8Scheme(from_checkpoint=True, static_input_scales=static, tensor_scales=tensor)


def _check_weights(w: dict[str, Any]) -> None:
    ok = (
        w.get("type") == "float"
        and int(w.get("num_bits", 0)) == 8
        and w.get("symmetric", True)
        and w.get("strategy") in _WEIGHT_STRATEGIES
        and not w.get("dynamic", False)
    )
    if not ok:
        raise ValueError(
            f"compressed-tensors weights {w!r} are not supported; need 8-bit float, "
            f"symmetric, static, strategy one of {_WEIGHT_STRATEGIES} (block-wise and "
            "group-wise FP8 are not)"
        )


def _check_activations(a: dict[str, Any] | None) -> bool:
    """True when the checkpoint has static (calibrated, per-tensor) input scales."""
    if a is None:
        return False  # weight-only FP8: activations still get per-token scales here
    if a.get("type") != "float" or int(a.get("num_bits", 0)) != 8 or not a.get("symmetric", True):
        raise ValueError(
            f"compressed-tensors input_activations {a!r} are not supported; need 8-bit "
            "float, symmetric"
        )
    if a.get("dynamic"):
        if a.get("strategy") not in ("token", None):
            raise ValueError(
                f"dynamic input_activations strategy {a.get('strategy')!r} is not "
                "supported; need 'token'"
            )
        return False
    return True


def full_rows(name: str, args: ModelArgs) -> int | None:
    """Output channels of the unsharded Hugging Face projection ``name`` (e.g.
    ``model.layers.0.self_attn.k_proj.weight_scale``), None for a non-projection."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    inter, hidden = args.intermediate_size, args.hidden_size
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": hidden}
    rows |= {"gate_proj": inter, "up_proj": inter, "down_proj": hidden}
    for proj, n in rows.items():
        if f".{proj}." in name:
            return n
    return None
