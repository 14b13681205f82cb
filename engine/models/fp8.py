"""FP8 (e4m3) weights for the decoder projections (docs/quantization.md).

Layout (one for both sources, ``fp8_loader.py``): each of qkv, o, gate|up and down is an
``Fp8Linear`` holding ``weight`` ``[N, K]`` float8_e4m3fn and ``weight_scale`` ``[N]``
float32 (one scale per output channel: ``W ≈ weight * weight_scale[:, None]``), and its
bias in the model dtype. The embedding, the norms and ``lm_head`` stay in the model dtype:
the logits are where a small error is most visible and ``lm_head`` is a small share of an
8B model's bytes. Under tensor parallelism each rank quantizes (or loads) its own shard, so
the scales shard with their output channels (docs/design.md §9).

How a projection runs (``fp8_linear``):
* CUDA, 1-4 rows, Triton layer ops: one Triton GEMV over the FP8 weights, activations in
  the model dtype, the scale applied per output (``triton_fp8_gemv.py``).
* CUDA otherwise: activations quantized per token (dynamic, one float32 scale per row, one
  Triton launch: ``triton_fp8_quant.py``), then ``torch._scaled_mm`` with row-wise scales (``scale_a`` ``[M, 1]``, ``scale_b``
  ``[1, N]``) on the FP8 tensor cores, or the split-K Triton GEMM (``triton_fp8_gemm.py``)
  for the shapes and row counts where it was measured faster.
* CPU (the reference, and where the tests run): the same per-token activation
  quantization, then a float32 matmul of the exact e4m3 values with the scales applied
  after, i.e. what ``_scaled_mm`` computes, up to float32 summation order.

Per-tensor scales (``EngineConfig.fp8_scales="tensor"``, vLLM's dynamic default;
``Fp8Linear.per_tensor``): the weight is quantized with one scale for the whole (fused)
tensor, still stored as ``[N]`` equal values so the GEMV, the split-K GEMM, the fused
kernels and tensor-parallel sharding run unchanged; the activations get ONE dynamic scale
per step (``quantize_tensor``; ``triton_fp8_quant.quantize_tensor_triton`` on CUDA) and
cuBLASLt runs its tensor-wise FP8 GEMM (scalar ``scale_a`` / ``scale_b``). An input the
fused kernels already quantized (``Fp8Act``) keeps its per-token scales.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.models.config import ModelArgs
from engine.models.fp8_loader import full_rows
from engine.models.layer_ops import LayerOps, TorchOps

if TYPE_CHECKING:
    from engine.models.triton_fp8_gemm import Fp8GemmConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Floor of a scale: an all-zero row (or token) would otherwise divide by zero.
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
_GEMV_ROWS = 4  # triton_fp8_gemv.MAX_ROWS, without importing triton on the CPU
_PROJECTIONS = (
    ("self_attn", "qkv_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_up_proj"),
    ("mlp", "down_proj"),
)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row e4m3 of a 2-D ``t``: ``(q, scale)`` with ``q`` float8_e4m3fn and
    ``scale`` ``[rows]`` float32 such that ``t ≈ q * scale[:, None]``; each row's largest
    magnitude maps to 448. Rows are output channels for weights, tokens for activations."""
    t32 = t.float()
    scale = (t32.abs().amax(dim=-1) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (t32 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_tensor(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-tensor e4m3 of ``t``: ``(q, scale)`` with ``scale`` ``[1]`` float32,
    ``t ≈ q * scale``; the largest magnitude of the whole tensor maps to 448. No host sync
    (the scale stays a device tensor)."""
    t32 = t.float()
    scale = (t32.abs().amax() / FP8_MAX).clamp(min=_MIN_SCALE).reshape(1)
    q = (t32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


@dataclass(slots=True)
class Fp8Act:
    """A projection's input already quantized per token by the kernel that made it
    (``triton_fp8_fused.py``); ``Fp8Linear`` takes it in place of a model-dtype tensor."""

    q: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M] float32: row i is q[i] * scale[i]
    dtype: torch.dtype  # the model dtype of the projection's output

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def fusable_input(proj: object, x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether ``proj`` would quantize ``x`` per token itself (an ``Fp8Linear`` on CUDA,
    more rows than the GEMV takes, tensor-core shapes), so the kernel making ``x`` may
    quantize it instead; ``residual``, when given, must be the norm's dense partner."""
    return x.is_cuda and fusable_shapes(proj, x, residual)


def fusable_shapes(proj: object, x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """``fusable_input`` on any device (the CPU tests run the fused kernels interpreted)."""
    if not (isinstance(proj, Fp8Linear) and x.dim() == 2):
        return False
    n, k = proj.weight.shape
    return (
        x.shape[0] > _GEMV_ROWS
        and x.stride(-1) == 1
        and k % 16 == 0
        and n % 16 == 0
        and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1))
    )


class Fp8Linear(nn.Module):
    """``x @ W.T + b`` with ``W`` stored as e4m3 and per-output-channel scales (see the
    module docstring). ``ops`` is the model's layer ops: the Triton ones enable the GEMV."""

    def __init__(
        self, in_features: int, out_features: int, bias: torch.Tensor | None, ops: LayerOps
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.zeros(out_features, in_features, dtype=FP8), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.ones(out_features, dtype=torch.float32), requires_grad=False
        )
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.ops = ops
        # One scale for the weight and one dynamic scale per step for the activations
        # (the module docstring); ``weight_scale`` then holds N equal values.
        self.per_tensor = False

    @classmethod
    def quantized(cls, linear: nn.Linear, ops: LayerOps, per_tensor: bool = False) -> Fp8Linear:
        """An ``Fp8Linear`` holding ``linear``'s weight quantized per output channel, or
        with one scale for the whole (fused: qkv, gate|up) weight when ``per_tensor``."""
        out = cls(linear.in_features, linear.out_features, linear.bias, ops)
        with torch.no_grad():
            if per_tensor:
                q, one = quantize_tensor(linear.weight)
                scale = one.expand(linear.out_features).contiguous()
            else:
                q, scale = quantize_rows(linear.weight)
            out.weight.data = q
            out.weight_scale.data = scale
        out.per_tensor = per_tensor
        return out

    def use_tensor_scale(self) -> None:
        """Switch a loaded layer to per-tensor scales: rows with a smaller scale than the
        largest (q, k and v of a per-tensor checkpoint each had their own) are requantized
        to the largest, as vLLM does for fused projections."""
        with torch.no_grad():
            s = self.weight_scale.data
            top = s.amax().reshape(1)
            ratio = (s / top).unsqueeze(1)
            q = (self.weight.data.float() * ratio).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            self.weight.data = q
            self.weight_scale.data = top.expand(s.shape[0]).contiguous()
        self.per_tensor = True

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:
        if isinstance(x, Fp8Act):
            mm = _mm_quantized if x.q.is_cuda else _reference_mm_quantized
            y = mm(x.q, x.scale, self.weight, self.weight_scale)
            return (y if self.bias is None else y + self.bias).to(x.dtype)
        gemv = self.ops.name == "triton" and getattr(self.ops, "use_gemv", False)
        return fp8_linear(
            x, self.weight, self.weight_scale, self.bias, gemv=gemv, per_tensor=self.per_tensor
        )

    def extra_repr(self) -> str:
        scales = "tensor" if self.per_tensor else "channel"
        return (
            f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, fp8 {scales}"
        )


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    gemv: bool = False,
    per_tensor: bool = False,
) -> torch.Tensor:
    """``x [..., K] @ (weight * scale[:, None]).T (+ bias)`` in ``x``'s dtype, by the path
    the module docstring names; ``gemv`` allows the Triton GEMV at 1-4 rows on CUDA;
    ``per_tensor``: one activation scale for all rows, ``scale`` holds equal values."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the FP8 weight {tuple(weight.shape)}")
    rows = x.reshape(-1, k)
    if rows.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], n))
    if gemv and rows.is_cuda and rows.shape[0] <= _GEMV_ROWS:
        from engine.models.triton_fp8_gemv import fp8_gemv_problem, launch_fp8_gemv

        if fp8_gemv_problem(rows, weight, scale, bias) is None:
            return launch_fp8_gemv(rows, weight, scale, bias).view(*x.shape[:-1], n)
    if rows.is_cuda and k % 16 == 0 and n % 16 == 0:
        y = _scaled_mm(rows, weight, scale, per_tensor)
    else:
        y = _reference_mm(rows, weight, scale, per_tensor)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype).view(*x.shape[:-1], n)


def _scaled_mm(
    rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, per_tensor: bool = False
) -> torch.Tensor:
    """W8A8 on the FP8 tensor cores; row-wise scaling writes bf16 (cast by the caller). The
    activations are quantized by one Triton launch (``triton_fp8_quant.py``: the torch
    form is eight kernels a projection, which cost more than FP8 saved at decode)."""
    if per_tensor:
        return _scaled_mm_tensor(rows, weight, scale)
    if rows.stride(-1) == 1:
        from engine.models.triton_fp8_quant import quantize_rows_triton

        xq, x_scale = quantize_rows_triton(rows, FP8_MAX, _MIN_SCALE)
    else:
        xq, x_scale = quantize_rows(rows)
    return _mm_quantized(xq, x_scale, weight, scale)


def _mm_quantized(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``(xq * x_scale[:, None]) @ (weight * scale[:, None]).T`` in bf16 on CUDA: the
    split-K Triton GEMM where it was measured faster, else cuBLASLt's row-wise FP8."""
    config = _tuned_split_k(xq.shape[0], weight)
    if config is not None:
        from engine.models.triton_fp8_gemm import fp8_gemm

        return fp8_gemm(xq, x_scale, weight, scale, config)
    return torch._scaled_mm(
        xq,
        weight.t(),  # [K, N] column-major, as cuBLASLt wants the second operand
        scale_a=x_scale.unsqueeze(1),
        scale_b=scale.unsqueeze(0),
        out_dtype=torch.bfloat16,
    )


def _scaled_mm_tensor(
    rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """Per-tensor W8A8: one dynamic activation scale, cuBLASLt's tensor-wise FP8 GEMM
    (scalar scales; its own kernels, not the row-wise ``ovscale`` one). The Triton GEMM's
    table was measured against the row-wise GEMM: only its split-K buckets (split_k > 1:
    more programs stream the weight at few rows, whatever the scales) are kept here, the
    one scale repeated over the rows; its plain tiles beat only the row-wise kernel."""
    if rows.stride(-1) == 1:
        from engine.models.triton_fp8_quant import quantize_tensor_triton

        xq, x_scale = quantize_tensor_triton(rows, FP8_MAX, _MIN_SCALE)
    else:
        xq, x_scale = quantize_tensor(rows)
    m = xq.shape[0]
    config = _tuned_split_k(m, weight)
    if config is not None and config.split_k > 1:
        from engine.models.triton_fp8_gemm import fp8_gemm

        return fp8_gemm(xq, x_scale.expand(m), weight, scale, config)
    return torch._scaled_mm(
        xq, weight.t(), scale_a=x_scale, scale_b=scale[:1], out_dtype=torch.bfloat16
    )


def _tuned_split_k(m: int, weight: torch.Tensor) -> Fp8GemmConfig | None:
    """The split-K Triton GEMM's config where it was measured faster than cuBLAS for this
    shape and row count (``triton_fp8_gemm.py``), else None."""
    from engine.models.triton_fp8_gemm import tuned_config

    return tuned_config(m, weight.shape[0], weight.shape[1])


def _reference_mm(
    rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, per_tensor: bool = False
) -> torch.Tensor:
    """What ``_scaled_mm`` computes, in float32 on any device (the CPU path)."""
    if per_tensor:
        xq, one = quantize_tensor(rows)
        x_scale = one.expand(rows.shape[0])
    else:
        xq, x_scale = quantize_rows(rows)
    return _reference_mm_quantized(xq, x_scale, weight, scale)


def _reference_mm_quantized(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    y = torch.nn.functional.linear(xq.float() * x_scale.unsqueeze(1), weight.float())
    return y * scale


def _projection_slots(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """(parent module, attribute) of every decoder projection of a LlamaForCausalLM."""
    for layer in model.layers:  # type: ignore[union-attr]
        yield from _layer_slots(layer)


def _layer_slots(layer: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    for part, attr in _PROJECTIONS:
        parent = getattr(layer, part)
        if hasattr(parent, attr):  # an MoE layer's mlp has experts instead
            yield parent, attr


def quantize_projections(
    model: nn.Module, ops: LayerOps = TorchOps, per_tensor: bool = False
) -> None:
    """Replace every decoder projection's ``nn.Linear`` by its FP8 quantization
    (``quantization="fp8"`` on an unquantized checkpoint); frees the originals."""
    for layer in model.layers:  # type: ignore[union-attr]
        quantize_layer(layer, ops, per_tensor)


def quantize_layer(layer: nn.Module, ops: LayerOps = TorchOps, per_tensor: bool = False) -> None:
    """One decoder layer's projections, and its experts (``MoEBlock.quantize``), to FP8:
    the layer-by-layer load (engine/models/loading.py) calls it as each layer is loaded.
    ``per_tensor``: the projections with per-tensor scales; experts stay per channel."""
    for parent, attr in _layer_slots(layer):
        linear = getattr(parent, attr)
        setattr(parent, attr, Fp8Linear.quantized(linear, ops, per_tensor))
    quantize_experts = getattr(getattr(layer, "mlp", None), "quantize", None)
    if quantize_experts is not None:
        quantize_experts()


def empty_fp8_projections(model: nn.Module, ops: LayerOps = TorchOps) -> None:
    """Replace every decoder projection by an ``Fp8Linear`` of its shape for an FP8
    checkpoint to load into (zero weights, unit scales, the bias parameter kept)."""
    for parent, attr in _projection_slots(model):
        linear = getattr(parent, attr)
        with torch.device(linear.weight.device):
            fp8 = Fp8Linear(linear.in_features, linear.out_features, linear.bias, ops)
        setattr(parent, attr, fp8)


def use_tensor_scales(model: nn.Module) -> None:
    """Every decoder projection of a loaded FP8 checkpoint to per-tensor scales
    (``Fp8Linear.use_tensor_scale``)."""
    for parent, attr in _projection_slots(model):
        proj = getattr(parent, attr)
        if isinstance(proj, Fp8Linear):
            proj.use_tensor_scale()


def cast_unquantized(model: nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` that leaves FP8 weights and their float32 scales alone
    (``Module.to`` would cast them: float8 counts as a floating-point dtype)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            if module.bias is not None:
                module.bias.data = module.bias.data.to(dtype)
            continue
        named = (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
        for name, tensor in named:
            # FP8 experts (engine/models/moe.py) keep their e4m3 weights and float32 scales.
            if tensor.dtype == FP8 or name.endswith("_scale"):
                continue
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)


def fp8_checkpoint_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], args: ModelArgs
) -> Iterator[tuple[str, torch.Tensor]]:
    """A compressed-tensors FP8 checkpoint's tensors in this engine's layout: every
    ``weight_scale`` as ``[output channels]`` float32 (a per-tensor scale repeated over its
    rows), ``input_scale`` tensors skipped (activations are scaled per token at run time).
    ``ValueError`` for a projection weight that is not e4m3 or a scale of the wrong size."""
    for name, tensor in weights:
        if name.endswith(".input_scale"):
            continue
        rows = full_rows(name, args)
        if rows is None:
            yield name, tensor
            continue
        if name.endswith(".weight_scale"):
            scale = tensor.float().reshape(-1)
            if scale.numel() == 1:
                scale = scale.expand(rows)
            elif scale.numel() != rows:
                raise ValueError(
                    f"{name}: {scale.numel()} scales for {rows} output channels (need one "
                    "per channel or one per tensor)"
                )
            yield name, scale.contiguous()
        elif name.endswith(".weight") and tensor.dtype != FP8:
            raise ValueError(f"{name} is {tensor.dtype} in an FP8 checkpoint; need float8_e4m3fn")
        else:
            yield name, tensor
