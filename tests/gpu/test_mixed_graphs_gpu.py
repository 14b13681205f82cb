"""Mixed prefill+decode steps replayed from CUDA graphs (engine/executor/mixed_graphs.py)
give the eager model's logits and KV cache: a GQA model of the Llama-8B head layout
(head_dim 128, 4 query heads per KV head) with the fused Triton ops, in float32, bfloat16
and FP8 (e4m3 weights and KV), over steps that land in buckets from 16 to 1024 tokens; and
the engine with mixed graphs on gives the greedy tokens of the engine with them off."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.seeds import fixed_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]

MAX_LEN = 1024
# (request, new tokens) per step over 9 requests: prefill chunks alone, chunks beside
# decodes, a step that fills its bucket (32), pure decodes, and steps of ~200 and ~700
# tokens (buckets 208 and 736 of mixed_buckets(1024)).
STEPS = [
    [(0, 7), (1, 13), (2, 5)],
    [(0, 1), (1, 1), (2, 1), (3, 20)],
    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 40)],
    [(0, 1), (1, 1), (3, 30)],
    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)],
    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 200)],
    [(0, 1), (2, 1), (5, 1), (6, 700)],
    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1), (7, 300), (8, 2)],
]
CASES = {
    "f32": (torch.float32, False, False),
    "bf16": (torch.bfloat16, False, False),
    "bf16_fp8_kv": (torch.bfloat16, True, False),
    "fp8_weights_and_kv": (torch.bfloat16, True, True),
}


@pytest.fixture(autouse=True)
def _free_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.parametrize("case", list(CASES))
def test_mixed_replay_matches_eager(case: str) -> None:
    from engine.attention.kv_quant import FP8_DTYPE
    from engine.attention.triton_backend import TritonAttention
    from engine.executor.mixed_graphs import MixedGraphs, mixed_buckets
    from engine.executor.step_testing import SyntheticRequests
    from engine.models import ModelArgs, build_model
    from engine.models.fp8_loader import Fp8Scheme

    dtype, fp8_kv, fp8_w = CASES[case]
    if (fp8_kv or fp8_w) and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    seed = fixed_seed()
    args = ModelArgs(
        architecture="LlamaForCausalLM", vocab_size=2000, hidden_size=512,
        intermediate_size=1024, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=MAX_LEN,
    )  # fmt: skip
    backend = TritonAttention()  # the engine's: an fp8 cache at unit scales (kv_quant.py)
    model = build_model(
        args, "", "dummy", backend, MAX_LEN, dtype, "cuda", seed % 1000, fused_ops=True,
        quantization=Fp8Scheme(from_checkpoint=False) if fp8_w else None,
    )  # fmt: skip
    reqs = SyntheticRequests(9, MAX_LEN, 16, args.vocab_size, seed, "cuda")
    shape = (2, 2, reqs.num_blocks, 16, 2, 128)
    cache_e = torch.zeros(shape, dtype=FP8_DTYPE if fp8_kv else dtype, device="cuda")
    cache_g = cache_e.clone()
    graphs = MixedGraphs(
        lambda ids, pos, meta: model(ids, pos, cache_g, meta),
        buckets=mixed_buckets(MAX_LEN), max_num_seqs=16, max_model_len=MAX_LEN,
        max_blocks_per_req=MAX_LEN // 16, hidden_size=args.hidden_size, dtype=dtype,
        device=torch.device("cuda"),
    )  # fmt: skip
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    with torch.inference_mode():
        graphs.capture()
        for i, chunks in enumerate(STEPS):
            s = reqs.step(chunks)
            n = s.input_ids.shape[0]
            eager = model.compute_logits(model(s.input_ids, s.positions, cache_e, s.meta))
            hidden = graphs.run(s.input_ids, s.positions, s.meta)
            graphed = model.compute_logits(hidden)
            t = graphs.bucket_for(n, len(chunks))
            assert t is not None and bool(graphs.buffers.hidden[:t].isfinite().all()), (
                f"{case} step {i}: padded rows not finite"
            )
            err = _rel(graphed[s.logits_indices], eager[s.logits_indices])
            assert err < tol, f"{case} step {i} ({n} tokens, seed={seed}): rel err {err:.3e}"
    assert graphs.num_replays == len(STEPS)
    cache_err = _rel(cache_g, cache_e)
    assert cache_err < (1e-4 if dtype == torch.float32 else 3e-2), f"{case}: cache {cache_err}"


TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def _generate(model_dir: Path, mixed: bool) -> tuple[dict[str, list[int]], int | None]:
    from engine.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        model=str(model_dir), device="cuda", dtype="float32", load_format="dummy",
        attention_backend="triton", num_kv_blocks=512, max_num_seqs=8,
        max_num_batched_tokens=96, mixed_cuda_graphs=mixed,
    )  # fmt: skip
    engine = LLMEngine(cfg)
    runner = engine.runner
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    lens = [5, 37, 90, 140, 3, 61, 250, 18]
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(lens))}
    pending = [
        (f"r{i}", [3 + (i * 7 + j * 13) % 990 for j in range(n)]) for i, n in enumerate(lens)
    ]
    while pending or engine.has_unfinished():
        for _ in range(min(2, len(pending))):  # staggered: chunks beside decodes
            rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
    replays = None if runner.mixed_graphs is None else runner.mixed_graphs.num_replays
    engine.shutdown()
    return got, replays


def test_engine_greedy_same_with_mixed_graphs_on_and_off(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY))
    off, none = _generate(model_dir, mixed=False)
    on, replays = _generate(model_dir, mixed=True)
    assert none is None
    assert replays is not None and replays > 0, "no step replayed a mixed graph"
    assert on == off
