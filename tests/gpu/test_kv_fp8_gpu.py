"""FP8 (e4m3) KV cache on the GPU: the Triton write/attention kernels against the torch
reference over the same fp8 cache (the interpreter runs these small on the CPU:
tests/unit/test_kv_fp8_triton.py), the fused RoPE + fp8 store, and a small random Llama's
teacher-forced logits and greedy tokens with an fp8 cache against a bfloat16 one
(docs/design.md §3 "KV cache dtype").
"""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.test_kv_fp8_triton import CASES, check_case, run_case, run_rope_store_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]

# Llama-3.1-8B's attention shapes (32 q heads over 8 KV heads, head_dim 128) in bf16.
GPU_CASES = {
    **CASES,
    "8b_decode_bf16": (
        [1] * 16,
        [700 + 37 * i for i in range(16)],
        32,
        8,
        128,
        16,
        "bfloat16",
        1.0,
        1.0,
        0,
    ),
    "8b_mixed_bf16": ([300, 1, 64, 1], [0, 2000, 129, 5], 32, 8, 128, 16, "bfloat16", 1.0, 1.0, 0),
}
SMALL: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(autouse=True)
def _free_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name", list(GPU_CASES))
def test_fp8_kernels_match_reference_on_gpu(name: str) -> None:
    seed = 1000 + list(GPU_CASES).index(name)  # fixed: a failure reruns the same inputs
    res = run_case(GPU_CASES[name], seed, "cuda")
    print(f"{name} seed={seed}: {res}")
    check_case(name, res, GPU_CASES[name][6])


@pytest.mark.parametrize("name", [n for n, spec in GPU_CASES.items() if spec[6] == "bfloat16"])
def test_fp8_kernels_with_fp16_tiles_on_gpu(name: str) -> None:
    """The e4m3 tiles converted to fp16 with the query pre-scaled (``f16_kv``): the
    same bounds as the bf16-tile path."""
    seed = 2000 + list(GPU_CASES).index(name)
    res = run_case(GPU_CASES[name], seed, "cuda", f16_kv=True)
    print(f"{name} f16 seed={seed}: {res}")
    check_case(name, res, GPU_CASES[name][6])


@pytest.mark.parametrize("seed", [3, 17, 2024])
def test_fused_rope_store_fp8_on_gpu(seed: int) -> None:
    res = run_rope_store_case(seed, "cuda", "bfloat16")
    print(res)
    assert res["untouched_changed"] == 0, res
    # The GPU folds one rounded bf16 product into an FMA (tests/gpu/test_rope_store_kv_gpu.py),
    # so a rotated k may sit one bf16 ulp from torch's and, rarely, round to the next e4m3.
    assert res["cache_byte_mismatches"] <= 0.01 * 2 * 21 * 2 * 64, res


def _save_random_llama(out: Path, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**SMALL)).to(torch.bfloat16).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("seed", [7, 1234])
def test_small_llama_fp8_kv_agreement(tmp_path: Path, seed: int) -> None:
    from engine.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine
    from tests.unit.kv_fp8_support import check_agreement, compare, run_sequence

    model = _save_random_llama(tmp_path / "small", seed)

    def engine(kv: str) -> LLMEngine:
        return LLMEngine(EngineConfig(
            model=str(model), device="cuda", dtype="bfloat16", attention_backend="triton",
            num_kv_blocks=256, kv_cache_dtype=kv, max_num_seqs=8,
        ))  # fmt: skip

    ref, fp8 = engine("auto"), engine("fp8")
    assert fp8.runner.kv_cache.dtype == torch.float8_e4m3fn
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(40, 200))] for _ in range(8)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs: dict[str, dict[str, list[int]]] = {}
    for name, e in (("ref", ref), ("fp8", fp8)):  # the real engine: batched, CUDA graphs
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, params)
        while e.has_unfinished():
            for o in e.step():
                got[o.request_id].extend(o.new_token_ids)
        outs[name] = got
    identical = sum(outs["ref"][k] == outs["fp8"][k] for k in outs["ref"])
    print(f"seed={seed}: free-running greedy identical for {identical}/{len(prompts)} prompts")
    results = []
    for i, p in enumerate(prompts):
        seq = p + outs["ref"][f"r{i}"][:-1]
        chunks = [len(p) // 2, len(p) - len(p) // 2]
        results.append(
            compare(run_sequence(ref.runner, seq, chunks), run_sequence(fp8.runner, seq, chunks))
        )
    # bf16 logits carry their own rounding (ulp 2**-7 near 1), hence wider bounds than the
    # float32 CPU test's.
    check_agreement(results, "bfloat16", rms_frac=0.1, max_frac=0.3)
