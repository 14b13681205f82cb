"""Decode steps replayed from CUDA graphs give the logits of the eager model, step after step."""

from __future__ import annotations

import random

import pytest
import torch

from tests.seeds import fixed_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]

BLOCK = 16


def _meta(
    q_lens: list[int], seq_lens: list[int], tables: list[list[int]], max_seq_len: int | None = None
):
    from engine.attention.base import AttentionMetadata

    slots, starts = [], [0]
    for q, s, t in zip(q_lens, seq_lens, tables, strict=True):
        slots += [t[p // BLOCK] * BLOCK + p % BLOCK for p in range(s - q, s)]
        starts.append(starts[-1] + q)
    width = max(len(t) for t in tables)
    bt = torch.zeros((len(tables), width), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    dev = "cuda"
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=bt.to(dev),
        max_query_len=max(q_lens),
        max_seq_len=max_seq_len or max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_graph_replay_matches_eager(dtype: torch.dtype) -> None:
    from engine.attention.triton_backend import TritonAttention
    from engine.executor.cuda_graphs import DecodeGraphs, default_buckets
    from engine.models import ModelArgs, build_model

    seed = fixed_seed()
    rng = random.Random(seed)
    args = ModelArgs(
        architecture="LlamaForCausalLM",
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
    )
    model = build_model(args, "", "dummy", TritonAttention(), 1024, dtype, "cuda", seed % 1000)
    max_len, n_blocks = 1024, 512
    cache = torch.zeros((2, 2, n_blocks, BLOCK, 2, 32), dtype=dtype, device="cuda")
    cache_eager = cache.clone()

    def forward(ids: torch.Tensor, pos: torch.Tensor, meta) -> torch.Tensor:
        return model.compute_logits(model(ids, pos, cache, meta))

    graphs = DecodeGraphs(
        forward,
        max_model_len=max_len,
        max_blocks_per_req=max_len // BLOCK,
        device=torch.device("cuda"),
        buckets=default_buckets(8),
    )
    with torch.inference_mode():
        graphs.capture()
        cache.zero_()  # capture ran the model on padding rows only; start clean anyway
        n = 5
        prompt_lens = [rng.randint(1, 300) for _ in range(n)]
        free = list(range(1, n_blocks))
        rng.shuffle(free)
        tables = [[free.pop() for _ in range(max_len // BLOCK // 2)] for _ in range(n)]
        prompts = [[rng.randrange(1000) for _ in range(p)] for p in prompt_lens]
        ids = torch.tensor(sum(prompts, []), device="cuda")
        pos = torch.tensor(sum((list(range(p)) for p in prompt_lens), []), device="cuda")
        meta = _meta(prompt_lens, prompt_lens, tables)
        for c in (cache, cache_eager):
            logits = model.compute_logits(model(ids, pos, c, meta))
        last = [sum(prompt_lens[: i + 1]) - 1 for i in range(n)]
        next_ids = logits[last].argmax(-1)
        seq = list(prompt_lens)
        for step in range(4):
            active = list(range(n)) if step % 2 == 0 else [0, 3]  # bucket 8, then bucket 2
            seq_now = [seq[i] + 1 for i in active]
            m = _meta([1] * len(active), seq_now, [tables[i] for i in active])
            d_ids, d_pos = next_ids[active], torch.tensor([seq[i] for i in active], device="cuda")
            eager = model.compute_logits(model(d_ids, d_pos, cache_eager, m))
            graphed = graphs.run(d_ids, d_pos, m).clone()
            err = float((graphed - eager).norm() / eager.norm())
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            assert err < tol, f"step {step} seed={seed}: graph vs eager rel err {err:.3e}"
            for i in active:
                seq[i] += 1
            next_ids = next_ids.clone()
            next_ids[active] = eager.argmax(-1)


def test_buckets_and_refusals() -> None:
    from engine.executor.cuda_graphs import DecodeGraphs, default_buckets

    assert default_buckets(1) == [1]
    assert default_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert default_buckets(256)[:6] == [1, 2, 4, 8, 16, 24] and default_buckets(256)[-1] == 256
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(
            lambda *a: a[0],
            max_model_len=8,
            max_blocks_per_req=1,
            device=torch.device("cpu"),
            buckets=[1],
        )
    g = DecodeGraphs(
        lambda *a: a[0],
        max_model_len=8,
        max_blocks_per_req=1,
        device=torch.device("cuda"),
        buckets=[2],
    )
    assert g.bucket_for(1) is None  # nothing captured yet: the caller runs eagerly
