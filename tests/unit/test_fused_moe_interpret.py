"""The fused MoE kernel (engine/models/triton_moe.py) on the CPU through Triton's
interpreter (a child process: tests/triton_interpreter.py) against the torch path
(engine/models/moe.py ``experts_reference``): decode-sized and prefill-sized batches,
experts that get no token, top-1 and top-k, bf16, and FP8 weights with per-(expert,
channel) scales against the reference on the dequantized weights, and gpt-oss's experts
(biases after both projections, the clamped SwiGLU with a limit the values cross). The
alignment (sort by expert, pad to the M tile) is checked on its own."""

from __future__ import annotations

import json

import pytest

from tests.seeds import fixed_seed
from tests.triton_interpreter import run_interpreted

# id: (tokens, hidden, inter, experts, top_k, dtype, fp8, block_m, gpt-oss experts)
CASES: dict[str, tuple[int, int, int, int, int, str, bool, int, bool]] = {
    "decode_t1_e8_k2": (1, 64, 32, 8, 2, "float32", False, 16, False),
    "batch_t13_e4_k2": (13, 64, 48, 4, 2, "float32", False, 16, False),
    "prefill_t70_e8_k3": (70, 32, 32, 8, 3, "float32", False, 32, False),
    "top1_t9_e16": (9, 32, 16, 16, 1, "float32", False, 16, False),
    "bf16_t20_e4_k2": (20, 64, 32, 4, 2, "bfloat16", False, 16, False),
    "fp8_t11_e4_k2": (11, 64, 32, 4, 2, "float32", True, 16, False),
    "gptoss_t13_e4_k2": (13, 64, 32, 4, 2, "float32", False, 16, True),
    "gptoss_fp8_t5_e8_k4": (5, 64, 32, 8, 4, "float32", True, 16, True),
    # Mixtral-8x7B FP8's batch-64 decode step (8 experts, top-2, 128 pairs), where the
    # H100 run asserted: the kernel is in bounds there (the cause was the bench's token
    # ids, tests/unit/test_moe_models_bench.py).
    "mixtral_fp8_t64_e8_k2": (64, 64, 32, 8, 2, "float32", True, 16, False),
}
LIMIT = 0.5  # gpt-oss's clamp, crossed by these random values (theirs is 7)
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _run_case(spec: tuple, seed: int) -> float:  # type: ignore[type-arg]
    from functools import partial

    import torch

    from engine.models.fp8 import quantize_rows
    from engine.models.gpt_oss import clamped_swiglu
    from engine.models.moe import experts_reference, route
    from engine.models.triton_moe import fused_experts

    tokens, hidden, inter, n_exp, top_k, dtype_name, fp8, block_m, oss = spec
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(n_exp, 2 * inter, hidden, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(n_exp, hidden, inter, generator=gen) * 0.1).to(dtype)
    logits = torch.randn(tokens, n_exp, generator=gen)
    weights, experts = route(logits, top_k, True, dtype)
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if fp8:
        q13, s13 = quantize_rows(w13.reshape(-1, hidden))
        q2, s2 = quantize_rows(w2.reshape(-1, inter))
        w13 = q13.view(n_exp, 2 * inter, hidden)
        w2 = q2.view(n_exp, hidden, inter)
        scales = (s13.view(n_exp, -1), s2.view(n_exp, -1))
        ref_w13 = w13.float() * scales[0][..., None]
        ref_w2 = w2.float() * scales[1][..., None]
    else:
        ref_w13, ref_w2 = w13.float(), w2.float()
    cfg = {"BLOCK_M": block_m, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
    extra: dict = {}  # type: ignore[type-arg]
    if oss:
        act = partial(clamped_swiglu, alpha=1.702, limit=LIMIT)
        b13 = torch.randn(n_exp, 2 * inter, generator=gen).to(dtype)
        b2 = torch.randn(n_exp, hidden, generator=gen).to(dtype)
        extra = {"w13_bias": b13, "w2_bias": b2, "act": act}
    out = fused_experts(x, w13, w2, weights, experts, *scales, config=cfg, **extra)
    if oss:
        extra = {"w13_bias": b13.float(), "w2_bias": b2.float(), "act": act}
    ref = experts_reference(x.float(), ref_w13, ref_w2, weights.float(), experts, **extra)
    return float((out.float() - ref).norm() / ref.norm())


def main() -> None:
    import torch

    torch.set_num_threads(1)
    seed = fixed_seed()
    results = {name: _run_case(spec, seed + i) for i, (name, spec) in enumerate(CASES.items())}
    print(json.dumps({"seed": seed, "results": results}))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, float]:
    payload, _ = run_interpreted(__file__)
    print(f"seed {payload['seed']}")
    results: dict[str, float] = payload["results"]
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_fused_matches_torch_path(interpreted: dict[str, float], name: str) -> None:
    err, tol = interpreted[name], TOL[CASES[name][5]]
    assert err < tol, f"{name}: relative error {err:.3e} >= {tol}"


def test_align_by_expert_groups_and_pads() -> None:
    """Every pair appears once, in its expert's run; runs start on tile boundaries; the
    blocks' experts match their rows; unused blocks are -1."""
    pytest.importorskip("triton")
    import torch

    from engine.models.triton_moe import align_by_expert

    experts = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]])
    sorted_pairs, block_expert = align_by_expert(experts, 6, 4)
    flat = experts.reshape(-1)
    real = sorted_pairs[sorted_pairs < flat.numel()].long()
    assert sorted(real.tolist()) == list(range(flat.numel()))
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_pairs[b * 4 : (b + 1) * 4].long()
        rows = rows[rows < flat.numel()]
        if e < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and bool((flat[rows] == e).all())
    # experts 0,1,2,3 get 2,2,1,5 pairs: 1+1+1+2 tiles used, the rest of the bound unused
    assert (block_expert >= 0).sum() == 5


if __name__ == "__main__":
    main()
