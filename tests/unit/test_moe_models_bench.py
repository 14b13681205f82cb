"""The decode-step inputs of the GPU benchmarks (benchmarks/gpu/gpu_bench_engine.py) on a
tiny Mixtral-like model in FP8 (8 experts, top-2, a 512-id vocabulary) on the CPU.

``python -m benchmarks.gpu.moe_models`` ran Qwen3-30B-A3B on an H100, then Mixtral-8x7B in
FP8 crashed in its batch-64 step with a device-side assert (``vectorized_gather_kernel``
index out of bounds): the step's token ids were drawn from [1000, 100000) whatever the
model, and Mixtral's vocabulary has 32,000 ids, so the embedding gathered rows past its
table (the batch-1 step got through only because its one id happened to fall below
32,000). On the CPU the same inputs raise ``IndexError`` in the embedding. The 1k/1k
prompts had the same range (the engine refused them: ``token ids must be in [0, 32000)``).
The step's blocks are checked against the KV pool too: a pool too small for the batch's
context is a clear error, not a reshape failure or block ids past the pool."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.gpu.gpu_bench_engine import (
    decode_step,
    decode_step_inputs,
    fit_context,
    prompts,
    run_batch,
)

VOCAB = 512
TINY_MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": VOCAB,
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
    "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
    "max_position_embeddings": 4096, "sliding_window": None, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
# 1024 usable blocks of 16 tokens: 64 requests of 256 tokens fill the pool exactly.
NUM_BLOCKS = 1025


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    model = tmp_path_factory.mktemp("tiny_mixtral")
    (model / "config.json").write_text(json.dumps(TINY_MIXTRAL))
    eng = LLMEngine(
        EngineConfig(
            model=str(Path(model)), load_format="dummy", device="cpu", quantization="fp8",
            max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=1024,
            num_kv_blocks=NUM_BLOCKS,
        )
    )  # fmt: skip
    yield eng
    eng.shutdown()


def test_fp8_moe_step_inputs_stay_inside_the_vocabulary(engine: Any) -> None:
    """The batch-64 step of the crashed row, run the way the captured graph runs it."""
    runner = engine.runner
    assert runner.model.layers[0].mlp.w13.dtype == torch.float8_e4m3fn  # FP8 experts
    for bs, ctx in ((1, 512), (64, 256)):
        tokens, pos, meta = decode_step_inputs(engine, bs, ctx)
        assert int(tokens.min()) >= 0 and int(tokens.max()) < VOCAB
        ids = meta.block_tables
        assert int(ids.min()) >= 1 and int(ids.max()) < runner.num_blocks
        assert ids.unique().numel() == ids.numel()  # no two requests share a block
        with torch.inference_mode():
            logits = runner.model.compute_logits(runner.model(tokens, pos, runner.kv_cache, meta))
        assert logits.shape == (bs, VOCAB) and bool(torch.isfinite(logits).all())


def test_decode_step_runs_eagerly_without_graphs(engine: Any) -> None:
    assert engine.runner.graphs is None  # the CPU: the eager path of ``decode_step``
    logits = decode_step(engine, 64, 256)()
    assert logits.shape == (64, VOCAB) and bool(torch.isfinite(logits).all())


def test_a_context_past_the_pool_is_a_clear_error(engine: Any) -> None:
    assert fit_context(engine, 64, 256) == 256
    assert fit_context(engine, 64, 1000) == 256  # 16 blocks each of 1024
    assert fit_context(engine, 1, 1000) == 1000
    assert fit_context(engine, 2048, 16) == 0  # not one block each
    with pytest.raises(ValueError, match=r"need 2048 KV blocks; the pool has 1024.*256 tokens"):
        decode_step_inputs(engine, 64, 512)


def test_prompts_stay_inside_the_vocabulary(engine: Any) -> None:
    batch = prompts(2, 24, 1, vocab=VOCAB)
    assert all(0 <= t < VOCAB for p in batch for t in p)
    # The Llama-3 rows keep their prompts: the default range is the one they ran with.
    assert max(t for p in prompts(4, 256, 5) for t in p) > 100_000
    out = run_batch(engine, batch, 3, "vocab")
    assert out["out_tokens"] == 6
