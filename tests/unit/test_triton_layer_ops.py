"""The fused element-wise Triton kernels (engine/models/triton_ops.py) against the torch
reference (``TorchOps``), on the CPU through Triton's interpreter.

As in test_triton_interpret.py, the interpreter must be on before triton is imported, so
the cases run in one child process (this file as a script) that prints JSON; each case is
its own test here. ``run_cases`` is shared with tests/gpu/test_layer_ops_gpu.py, which runs
the same cases at full size on the GPU.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from tests.seeds import fixed_seed
from tests.triton_interpreter import interpreted_results

# name: (op, rows/tokens, width or (q_heads, kv_heads, head_dim), dtype)
SMALL_CASES: dict[str, tuple[str, int, Any, str]] = {
    "rms_norm_f32": ("rms_norm", 5, 64, "float32"),
    "rms_norm_bf16_odd_width": ("rms_norm", 3, 96, "bfloat16"),
    "add_rms_norm_f32": ("add_rms_norm", 7, 64, "float32"),
    "add_rms_norm_bf16": ("add_rms_norm", 4, 128, "bfloat16"),
    "silu_mul_f32": ("silu_mul", 6, 80, "float32"),
    "silu_mul_bf16": ("silu_mul", 3, 2100, "bfloat16"),
    "rope_gqa_f32": ("rope", 9, (4, 2, 64), "float32"),
    "rope_gqa_bf16": ("rope", 5, (6, 2, 32), "bfloat16"),
    "rope_mha_bf16_d128": ("rope", 2, (3, 3, 128), "bfloat16"),
    "qk_norm_heads_bf16": ("head_norm", 4, (6, 2, 64), "bfloat16"),
    "model_tiny_f32": ("model", 11, None, "float32"),
}
# Error = largest absolute difference over the reference's largest magnitude. On the GPU
# the kernels round to bf16 where torch does, leaving float32 summation-order differences
# that can flip one bf16 rounding (2^-8 of a value). Triton's interpreter truncates on a
# cast to bf16 instead of rounding (checked: every cast matched truncation), a one-ulp
# error at each of the few casts in a chain, hence a looser CPU bound.
TOL = {"float32": 2e-6, "bfloat16": 2**-5}
GPU_TOL = {"float32": 2e-6, "bfloat16": 2**-7}


def _max_rel(a: Any, b: Any) -> float:
    a, b = a.float(), b.float()
    if not a.numel():
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def _case(op: str, n: int, shape: Any, dtype_name: str, device: str, seed: int) -> float:
    """Largest relative difference between TritonOps and TorchOps on one random input."""
    import torch

    from engine.models.layer_ops import TorchOps
    from engine.models.triton_ops import TritonOps

    torch.manual_seed(seed)
    dtype = getattr(torch, dtype_name)

    def rand(*s: int) -> torch.Tensor:
        return torch.randn(s, device=device).to(dtype)

    if op == "rms_norm":
        x, w = rand(n, shape), rand(shape)
        return _max_rel(TritonOps.rms_norm(x, w, 1e-5), TorchOps.rms_norm(x, w, 1e-5))
    if op == "add_rms_norm":
        x, res, w = rand(n, shape), rand(n, shape), rand(shape)
        want_out, want_res = TorchOps.add_rms_norm(x, res.clone(), w, 1e-6)
        got_out, got_res = TritonOps.add_rms_norm(x, res, w, 1e-6)
        if got_res.data_ptr() != res.data_ptr():
            return float("inf")  # the residual stream must be updated in place
        return max(_max_rel(got_out, want_out), _max_rel(got_res, want_res))
    if op == "silu_mul":
        gu = rand(n, 2 * shape)
        return _max_rel(TritonOps.silu_mul(gu), TorchOps.silu_mul(gu))
    if op == "model":
        return _model_case(n, dtype, device, seed)
    hq, hk, d = shape
    # q, k, v as the model sees them: strided views of one fused projection output.
    qkv = rand(n, (hq + 2 * hk) * d)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(n, hk, d)
    if op == "head_norm":  # Qwen3's q/k norm over each head
        w = rand(d)
        return _max_rel(TritonOps.rms_norm(q, w, 1e-6), TorchOps.rms_norm(q, w, 1e-6))
    if op == "rope":
        from engine.models.rope import RotaryEmbedding

        rope = RotaryEmbedding(d, 4096, 500000.0, {}).to(device)
        pos = torch.randint(0, 4096, (n,), device=device)
        got = TritonOps.rope(pos, q, k, rope.cos, rope.sin)
        want = TorchOps.rope(pos, q, k, rope.cos, rope.sin)
        return max(_max_rel(got[0], want[0]), _max_rel(got[1], want[1]))
    raise ValueError(f"unknown op {op!r}")


def tiny_llama(dtype: Any, device: str, ops: Any, backend: Any, seed: int) -> Any:
    """A tiny Llama (2 layers, 4 heads / 2 KV heads of 16, vocab 256), weights from
    ``seed`` (the same for every ``ops``/``backend``), float32 RoPE tables as
    ``build_model`` keeps them (bf16 ones would send the RoPE kernels to their torch
    fallback, and a case would not run them at all)."""
    import torch

    from engine.models.config import ModelArgs
    from engine.models.llama import LlamaForCausalLM

    args = ModelArgs.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
        }
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(args, backend, 512, ops).to(dtype).eval()
    model.rope.cos, model.rope.sin = model.rope.cos.float(), model.rope.sin.float()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return model


def _model_case(n: int, dtype: Any, device: str, seed: int) -> float:
    """The tiny Llama built twice with the same weights, once per ops class."""
    import torch

    from engine.attention.torch_ref import TorchRefAttention
    from engine.attention.triton_testing import make_case
    from engine.models.layer_ops import TorchOps
    from engine.models.triton_ops import TritonOps

    outs = []
    for ops in (TorchOps, TritonOps):
        model = tiny_llama(dtype, device, ops, TorchRefAttention(), seed)
        case = make_case(
            [n], [0], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
            dtype=dtype, device=device, seed=seed,
        )  # fmt: skip
        cache = torch.zeros((2, *case.kv_cache.shape), dtype=dtype, device=device)
        ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))
        with torch.inference_mode():
            outs.append(model(ids.to(device), torch.arange(n, device=device), cache, case.meta))
    return _max_rel(outs[1], outs[0])


def run_cases(cases: dict[str, tuple[str, int, Any, str]], device: str) -> dict[str, float]:
    seed = fixed_seed()
    print(f"seed {seed}", file=sys.stderr)
    return {name: _case(*spec, device, seed + i) for i, (name, spec) in enumerate(cases.items())}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, float]:
    return interpreted_results(__file__)


@pytest.mark.parametrize("name", list(SMALL_CASES))
def test_fused_op_matches_torch(interpreted: dict[str, float], name: str) -> None:
    tol = TOL[SMALL_CASES[name][3]]
    assert interpreted[name] < tol, f"{name}: relative difference {interpreted[name]:.3e} >= {tol}"


def test_cpu_engine_keeps_torch_ops() -> None:
    """Only CUDA gets the kernels; the CPU path stays the exact HF-parity reference."""
    from engine.models import get_layer_ops
    from engine.models.layer_ops import TorchOps

    assert get_layer_ops("cpu", fused=True) is TorchOps
    assert get_layer_ops("cuda", fused=False) is TorchOps


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    print(json.dumps(run_cases(SMALL_CASES, "cpu")))
