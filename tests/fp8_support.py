"""Helpers of the FP8 weight tests (tests/unit/test_fp8_*.py, tests/gpu/test_fp8_gpu.py):
a compressed-tensors FP8 checkpoint written by hand, and teacher-forced logits.

The checkpoint writer is deliberately independent of ``engine/models/fp8.py``: it follows
the published format (``quantization_config`` with ``quant_method: compressed-tensors``,
``format: float-quantized``; projection weights as float8_e4m3fn with ``weight_scale``
``[N, 1]`` per channel or ``[1]`` per tensor), so loading it tests the loader, not a
round trip through our own quantizer.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantization_config(strategy: str, static_input: bool = False) -> dict[str, Any]:
    """A compressed-tensors ``quantization_config`` as llm-compressor writes it for the
    FP8 / FP8-dynamic schemes."""
    inputs: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True}
    inputs |= (
        {"dynamic": False, "strategy": "tensor"}
        if static_input
        else {"dynamic": True, "strategy": "token"}
    )
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights | {"strategy": strategy, "observer": "minmax"},
                "input_activations": inputs,
            }
        },
    }


def write_fp8_checkpoint(
    src: Path,
    out: Path,
    strategy: str = "channel",
    scale_dtype: torch.dtype = torch.float32,
    static_input: bool = False,
) -> Path:
    """``src`` (an unquantized single-file checkpoint) as a compressed-tensors FP8 one in
    ``out``: each projection's weight quantized per output channel or per tensor (its
    largest magnitude at 448), ``weight_scale`` in ``scale_dtype``, and with
    ``static_input`` an ``input_scale`` per projection as calibrated checkpoints carry."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    result: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        proj = name.endswith(".weight") and any(f".{p}." in name for p in PROJECTIONS)
        if not proj:
            result[name] = t
            continue
        w = t.float()
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax()
        scale = (
            (amax / 448.0).reshape(-1, 1) if strategy == "channel" else (amax / 448.0).reshape(1)
        )
        q = (w / (scale if strategy == "channel" else scale[0])).to(torch.float8_e4m3fn)
        result[name] = q.contiguous()
        base = name.removesuffix(".weight")
        result[f"{base}.weight_scale"] = scale.to(scale_dtype).contiguous()
        if static_input:
            result[f"{base}.input_scale"] = torch.tensor([0.05], dtype=scale_dtype)
    save_file(result, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(strategy, static_input)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copyfile(f, out / f.name)
    return out


def prefill_logits(
    model_dir: Path,
    token_ids: list[int],
    quantization: str | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend_name: str = "torch_ref",
    fp8_scales: str = "channel",
) -> torch.Tensor:
    """Float32 logits ``[len(token_ids), vocab]`` of one teacher-forced prefill of
    ``token_ids`` through the engine's model (FP8 when ``quantization`` or the checkpoint
    says so, with ``fp8_scales``), on the model's own paged KV cache."""
    return logits_fn(model_dir, quantization, device, dtype, backend_name, fp8_scales=fp8_scales)(
        token_ids
    )


def logits_fn(
    model_dir: Path,
    quantization: str | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend_name: str = "torch_ref",
    max_len: int = 512,
    fp8_scales: str = "channel",
) -> Callable[[list[int]], torch.Tensor]:
    """``prefill_logits`` with the model built once, for sequences up to ``max_len``."""
    from engine.attention import get_backend
    from engine.config import EngineConfig
    from engine.models import ModelArgs, build_model

    cfg = EngineConfig(
        model=str(model_dir), device=device, quantization=quantization, fp8_scales=fp8_scales
    )
    args = ModelArgs.from_hf(cfg.hf_config())
    backend = get_backend(backend_name, device)
    model = build_model(
        args, str(model_dir), "auto", backend, max_len, dtype, device,
        fused_ops=device != "cpu", quantization=cfg.quantization_scheme(),
    )  # fmt: skip

    def run(token_ids: list[int]) -> torch.Tensor:
        from engine.attention.base import AttentionMetadata

        n, block = len(token_ids), 16
        if n > max_len:
            raise ValueError(f"{n} tokens exceed max_len {max_len}")
        blocks = -(-n // block)
        cache = torch.zeros(
            (args.num_layers, 2, blocks + 1, block, args.num_kv_heads, args.head_dim),
            dtype=dtype,
            device=device,
        )
        i32 = {"dtype": torch.int32, "device": device}
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=device) + block,
            query_start_loc=torch.tensor([0, n], **i32),
            seq_lens=torch.tensor([n], **i32),
            block_tables=torch.arange(1, blocks + 1, **i32)[None],
            max_query_len=n,
            max_seq_len=n,
            query_start_loc_cpu=[0, n],
            seq_lens_cpu=[n],
        )
        ids = torch.tensor(token_ids, device=device)
        with torch.inference_mode():
            hidden = model(ids, torch.arange(n, device=device), cache, meta)
            return model.compute_logits(hidden)

    return run


def logit_stats(ref: torch.Tensor, test: torch.Tensor) -> dict[str, float]:
    """Relative L2 error of ``test`` against ``ref`` over all positions, the largest
    absolute error relative to ``ref``'s largest magnitude, and top-1 agreement."""
    ref, test = ref.double(), test.double()
    return {
        "rel_l2": float((test - ref).norm() / ref.norm()),
        "max_rel": float((test - ref).abs().max() / ref.abs().max()),
        "top1": float((test.argmax(-1) == ref.argmax(-1)).double().mean()),
    }
