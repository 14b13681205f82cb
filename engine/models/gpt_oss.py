"""gpt-oss (``GptOssForCausalLM``): what differs from the other MoE models, as data for the
shared decoder (engine/models/llama.py, moe.py) plus its checkpoint conversion.

* Attention: q/k/v and o projections with biases; one learned sink logit per head
  (``AttentionBackend.forward(sinks=)``, docs/design.md §3 "Attention sinks"); layers
  alternate sliding-window (128) and full attention (``layer_types``); YaRN rope.
* MoE: a router with a bias (top-k of its logits, softmax over those k: the same weights
  as softmax, top-k, renormalise); experts with biases and a clamped SwiGLU,
  ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.
* Checkpoint: experts stacked, ``gate_up_proj`` ``[E, H, 2I]`` with gate and up columns
  interleaved, ``down_proj`` ``[E, I, H]``; in the published checkpoints MXFP4
  (``*_blocks`` ``[E, rows, K/32, 16]`` uint8, two e2m1 values a byte, low nibble first,
  and ``*_scales`` ``[E, rows, K/32]`` uint8 e8m0 exponents biased by 127). Hopper has no
  MXFP4 kernel here, so they are dequantized at load to bf16 (exact: every MXFP4 value is
  a bf16 value), and with ``--quantization fp8`` on to FP8 layer by layer like any
  unquantized checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

ARCH = "GptOssForCausalLM"
# e2m1 values by their 4-bit code (sign bit high).
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_PROJ = ("gate_up_proj", "down_proj")


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation of ``gate_up = [gate | up]`` (the module docstring)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``[*prefix, K]`` values of MXFP4 ``blocks`` ``[*prefix, K/32, 16]`` with e8m0
    ``scales`` ``[*prefix, K/32]``; ``ValueError`` for shapes that do not pair up."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}"
        )
    lut = torch.tensor(_FP4, dtype=torch.float32, device=blocks.device)
    lo, hi = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    vals = torch.stack((lo, hi), dim=-1).flatten(-2)  # [*prefix, G, 32]
    vals = torch.ldexp(vals, scales.to(torch.int32).unsqueeze(-1) - 127)
    return vals.flatten(-2).to(dtype)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up rows (or columns) along ``dim`` as ``[gate | up]``."""
    n = t.shape[dim]
    idx = torch.cat((torch.arange(0, n, 2), torch.arange(1, n, 2))).to(t.device)
    return t.index_select(dim, idx)


def gpt_oss_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under the engine's names: the router as ``mlp.gate``, the
    experts stacked as ``mlp.w13`` ``[E, 2I, H]`` (gate rows then up rows), ``mlp.w2``
    ``[E, H, I]`` and their biases; MXFP4 pairs dequantized as they complete (a layer's
    blocks and scales arrive together in the layer-ordered load)."""
    pending: dict[str, torch.Tensor] = {}
    for name, t in weights:
        if ".mlp.router." in name:
            yield name.replace(".mlp.router.", ".mlp.gate."), t
            continue
        if ".mlp.experts." not in name:
            yield name, t
            continue
        base, _, leaf = name.rpartition(".mlp.experts.")
        if leaf.endswith(("_blocks", "_scales")):
            proj, _, part = leaf.rpartition("_")
            pending[f"{base}|{proj}|{part}"] = t
            blocks = pending.get(f"{base}|{proj}|blocks")
            scales = pending.get(f"{base}|{proj}|scales")
            if blocks is None or scales is None:
                continue
            del pending[f"{base}|{proj}|blocks"], pending[f"{base}|{proj}|scales"]
            # [E, out, in] already (the unquantized checkpoint's transpose).
            yield _expert(base, proj, dequantize_mxfp4(blocks, scales), transposed=False)
        elif leaf in _PROJ:
            yield _expert(base, leaf, t, transposed=True)
        elif leaf == "gate_up_proj_bias":
            yield f"{base}.mlp.w13_bias", _deinterleave(t, 1)
        elif leaf == "down_proj_bias":
            yield f"{base}.mlp.w2_bias", t
        else:
            raise ValueError(f"unexpected weight {name!r} in a gpt-oss checkpoint")
    if pending:
        raise ValueError(f"MXFP4 blocks without scales (or the reverse): {sorted(pending)[:3]}")


def _expert(base: str, proj: str, t: torch.Tensor, transposed: bool) -> tuple[str, torch.Tensor]:
    if transposed:  # [E, in, out] as transformers holds them
        t = t.transpose(1, 2)
    if proj == "gate_up_proj":
        return f"{base}.mlp.w13", _deinterleave(t, 1)
    return f"{base}.mlp.w2", t
