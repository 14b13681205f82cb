"""Helpers of the FP8 tests (tests/unit/test_fp8_*.py, tests/gpu/test_fp8_*gpu.py): a
compressed-tensors FP8 checkpoint written by hand, teacher-forced logits, how many greedy
tokens are the reference's argmax, and how far a Triton quantization is from torch's.

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


def argmax_agreement(
    model_dir: Path,
    prompts: list[list[int]],
    outs: list[list[int]],
    want_len: int,
    **prefill_kw: Any,
) -> tuple[int, int]:
    """``(agree, total)``: how many generated tokens (each ``outs[i]`` must be ``want_len``
    long) are the argmax of the reference model at the same position, the reference being a
    teacher-forced ``prefill_logits(model_dir, prompts[i] + outs[i], **prefill_kw)``."""
    agree = total = 0
    for p, out in zip(prompts, outs):
        assert len(out) == want_len
        choice = prefill_logits(model_dir, p + out, **prefill_kw)[len(p) - 1 : -1].argmax(-1)
        agree += sum(a == b for a, b in zip(out, choice.tolist()))
        total += len(out)
    return agree, total


def graphed_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    max_tokens: int,
    check: Callable[[Any], None] | None = None,
    **engine_kw: Any,
) -> list[list[int]]:
    """Greedy tokens of ``prompts`` from a bf16 Triton engine on CUDA whose decode steps
    replay CUDA graphs (asserted), configured further by ``engine_kw`` (the quantization);
    ``check`` sees the engine before it runs. The engine is freed before this returns."""
    from engine.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        model=str(model_dir), device="cuda", dtype="bfloat16", attention_backend="triton",
        num_kv_blocks=256, max_num_seqs=8, **engine_kw,
    )  # fmt: skip
    engine = LLMEngine(cfg)
    assert engine.runner.graphs is not None  # decode steps replay CUDA graphs
    if check is not None:
        check(engine)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
        got[f"r{i}"] = []
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    del engine
    return [got[f"r{i}"] for i in range(len(prompts))]


def e4m3_mismatch(
    q: torch.Tensor, s: torch.Tensor, q_ref: torch.Tensor, s_ref: torch.Tensor
) -> dict[str, float]:
    """How far a Triton quantization ``(q, s)`` is from torch's ``(q_ref, s_ref)`` (the
    interpreter tests tests/unit/test_fp8_quant_kernel.py and test_fp8_tensor_scales.py,
    and their GPU runs): the scales' largest relative error, the e4m3 values' largest
    difference in e4m3 steps, the share that differ, sign flips, and the dtypes."""
    qf, rf = q.float(), q_ref.float()
    # One e4m3 step is 2^-3 of the magnitude among normals; below the smallest normal
    # (2^-6) the spacing is 2^-9, and the interpreter flushes there, hence the floor.
    diff = (qf - rf).abs()
    allowed = torch.maximum(rf.abs() * 2.0**-3, torch.full_like(diff, 2.0**-6))
    # The interpreter's float -> e4m3 cast also drops the carry when rounding up reaches the
    # next power of two (127.03 -> 64 instead of 128): on the interpreter only, such halves
    # are counted apart and reported; the GPU tests demand none.
    mag = rf.abs()
    carry_lost = (mag > 0) & (mag == torch.exp2(torch.log2(mag).round())) & (qf * 2 == rf)
    diff = torch.where(carry_lost, torch.zeros_like(diff), diff)
    return {
        "scale_rel_err": float(((s - s_ref).abs() / s_ref).max()),
        "carry_lost": float(carry_lost.float().sum()),
        "max_steps": float((diff / allowed).max()),
        "mismatch_fraction": float((qf != rf).float().mean()),
        "sign_flips": float(((qf * rf) < 0).float().sum()),
        "dtype_ok": float(q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32),
    }
