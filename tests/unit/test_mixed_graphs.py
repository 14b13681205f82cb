"""Mixed-step graphs (engine/executor/mixed_graphs.py) on the CPU: the buckets, the padding
of the static buffers, and, through Triton's interpreter with ``EagerCapture`` standing in
for CUDA graphs, a tiny model's steps of prefill chunks and decodes replayed from the
padded buffers giving the eager model's logits and KV cache. The same steps with real CUDA
graphs are tests/gpu/test_mixed_graphs_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch

from engine.executor.mixed_graphs import EagerCapture, MixedBuffers, MixedGraphs, mixed_buckets
from engine.executor.step_testing import SyntheticRequests
from tests.seeds import fixed_seed
from tests.triton_interpreter import run_interpreted

# Steps over 6 requests: prefill chunks, chunks beside decodes, a step that fills its
# bucket exactly (no padding token), pure decodes, and a step whose request count is the
# most its bucket holds.
STEPS = [
    [(0, 7), (1, 13), (2, 5)],
    [(0, 1), (1, 1), (2, 1), (3, 20)],
    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 40)],
    [(0, 1), (1, 1), (3, 30)],
    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)],
    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 11)],
]
MAX_LEN = 96


def test_bucket_ladder() -> None:
    b = mixed_buckets(2048)
    assert b[:3] == [16, 32, 48] and 256 in b and 288 in b and 320 in b and b[-1] == 2048
    steps = {y - x for x, y in zip(b, b[1:], strict=False)}
    assert steps == {16, 32, 64}
    assert mixed_buckets(300)[-3:] == [256, 288, 300]
    assert mixed_buckets(15) == []
    assert mixed_buckets(8192)[-2:] == [7936, 8192]


def _fake_graphs(max_tokens: int, max_num_seqs: int) -> tuple[MixedGraphs, list[dict]]:
    """Graphs over a forward that records what it read and returns [id, position, slot]."""
    seen: list[dict] = []

    def forward(ids: torch.Tensor, pos: torch.Tensor, meta) -> torch.Tensor:
        seen.append(
            {
                "tokens": ids.shape[0],
                "qsl": meta.query_start_loc.tolist(),
                "seq_lens": meta.seq_lens.tolist(),
                "slots": meta.slot_mapping.tolist(),
                "max_query_len": meta.max_query_len,
            }
        )
        return torch.stack((ids, pos, meta.slot_mapping), dim=1).float()

    graphs = MixedGraphs(
        forward,
        buckets=mixed_buckets(max_tokens),
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_LEN,
        max_blocks_per_req=MAX_LEN // 16,
        hidden_size=3,
        dtype=torch.float32,
        device=torch.device("cpu"),
        make_capture=EagerCapture,
    )
    graphs.capture()
    return graphs, seen


def test_replay_reads_padded_buffers() -> None:
    graphs, seen = _fake_graphs(64, max_num_seqs=8)
    assert [s["tokens"] for s in seen] == [64, 48, 32, 16]  # captured largest first
    # Captured with every row padding: one request of all tokens, seq_len 0.
    assert seen[0]["qsl"] == [0] + [64] * 9 and seen[0]["seq_lens"] == [0] * 9
    reqs = SyntheticRequests(6, MAX_LEN, 16, 100, fixed_seed(), "cpu")
    for chunks in STEPS:
        step = reqs.step(chunks)
        n, r = step.input_ids.shape[0], len(chunks)
        out = graphs.run(step.input_ids, step.positions, step.meta)
        want = torch.stack((step.input_ids, step.positions, step.meta.slot_mapping), 1)
        assert torch.equal(out, want.float()), chunks
        t = graphs.bucket_for(n, r)
        assert t is not None and t >= n and t - n < 16
        got = seen[-1]
        assert got["tokens"] == t and got["max_query_len"] == t
        assert got["qsl"] == step.meta.query_start_loc_cpu + [t] * (graphs.rows_for(t) - r)
        assert got["seq_lens"] == step.meta.seq_lens_cpu + [0] * (graphs.rows_for(t) - r)
        assert got["slots"][n:] == [-1] * (t - n)
    assert graphs.num_replays == len(STEPS)


def test_bucket_refusals() -> None:
    graphs, _ = _fake_graphs(64, max_num_seqs=4)
    assert graphs.rows_for(16) == 5 and graphs.rows_for(64) == 5
    assert graphs.bucket_for(10, 4) == 16
    assert graphs.bucket_for(10, 5) is None  # more requests than max_num_seqs
    assert graphs.bucket_for(65, 2) is None  # more tokens than the largest bucket
    reqs = SyntheticRequests(1, 96, 16, 100, 0, "cpu")
    step = reqs.step([(0, 70)])
    with pytest.raises(ValueError, match="no captured mixed graph"):
        graphs.run(step.input_ids, step.positions, step.meta)


def test_needs_cuda_without_a_capture_factory() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        MixedGraphs(
            lambda i, p, m: i,
            buckets=[16],
            max_num_seqs=4,
            max_model_len=64,
            max_blocks_per_req=4,
            hidden_size=1,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )


def test_buffers_load_leaves_no_previous_step_behind() -> None:
    """A small step after a large one: the rows past it are padding again."""
    b = MixedBuffers.allocate(32, 9, 6, 2, torch.float32, torch.device("cpu"))
    reqs = SyntheticRequests(4, 96, 16, 100, 1, "cpu")
    big = reqs.step([(0, 10), (1, 12), (2, 9)])
    b.load(big.input_ids, big.positions, big.meta, 32, 9)
    small = reqs.step([(3, 3)])
    b.load(small.input_ids, small.positions, small.meta, 16, 9)
    assert b.slot_mapping[3:16].tolist() == [-1] * 13
    assert b.query_start_loc[:10].tolist() == [0, 3] + [16] * 8
    assert b.seq_lens.tolist() == [3] + [0] * 8


# --- a tiny model through Triton's interpreter (child process) --------------------------

CASES = {
    "f32": {"kv": "auto", "fp8": False},
    "fp8_kv_and_weights": {"kv": "fp8", "fp8": True},
}


def _run_model_case(kv: str, fp8: bool, seed: int) -> dict[str, float]:
    from engine.attention.kv_quant import FP8_DTYPE
    from engine.attention.triton_backend import TritonAttention
    from engine.models import ModelArgs, build_model
    from engine.models.fp8_loader import Fp8Scheme

    args = ModelArgs(
        architecture="LlamaForCausalLM",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=MAX_LEN,
    )
    backend = TritonAttention(k_scale=0.05, v_scale=0.04) if kv == "fp8" else TritonAttention()
    quant = Fp8Scheme(from_checkpoint=False) if fp8 else None
    model = build_model(
        args, "", "dummy", backend, MAX_LEN, torch.float32, "cpu", seed % 1000,
        quantization=quant,
    )  # fmt: skip
    reqs = SyntheticRequests(6, MAX_LEN, 16, args.vocab_size, seed, "cpu")
    cache_dtype = FP8_DTYPE if kv == "fp8" else torch.float32
    shape = (2, 2, reqs.num_blocks, 16, 2, 16)
    cache_e = torch.zeros(shape, dtype=cache_dtype)
    cache_g = torch.zeros(shape, dtype=cache_dtype)
    graphs = MixedGraphs(
        lambda ids, pos, meta: model(ids, pos, cache_g, meta),
        buckets=mixed_buckets(64),
        max_num_seqs=8,
        max_model_len=MAX_LEN,
        max_blocks_per_req=MAX_LEN // 16,
        hidden_size=args.hidden_size,
        dtype=torch.float32,
        device=torch.device("cpu"),
        make_capture=EagerCapture,
    )
    with torch.inference_mode():
        graphs.capture()
        err, agree, finite = 0.0, True, True
        for chunks in STEPS:
            s = reqs.step(chunks)
            eager = model.compute_logits(
                model(s.input_ids, s.positions, cache_e, s.meta)[s.logits_indices]
            )
            hidden = graphs.run(s.input_ids, s.positions, s.meta)
            t = graphs.bucket_for(s.input_ids.shape[0], len(chunks))
            finite = finite and bool(graphs.buffers.hidden[:t].isfinite().all())
            graph = model.compute_logits(hidden[s.logits_indices])
            err = max(err, float((eager - graph).abs().max()))
            agree = agree and bool(torch.equal(eager.argmax(-1), graph.argmax(-1)))
    cache_diff = (cache_e.float() - cache_g.float()).abs().max()
    return {"err": err, "agree": agree, "finite": finite, "cache_err": float(cache_diff)}


def main() -> None:
    torch.set_num_threads(1)
    seed = fixed_seed()
    out = {name: _run_model_case(c["kv"], c["fp8"], seed) for name, c in CASES.items()}
    print(json.dumps({"seed": seed, "results": out}))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, float]]:
    payload, _ = run_interpreted(__file__)
    print(f"seed {payload['seed']}")
    results: dict[str, dict[str, float]] = payload["results"]
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_tiny_model_replay_matches_eager(
    interpreted: dict[str, dict[str, float]], name: str
) -> None:
    res = interpreted[name]
    assert res["cache_err"] == 0.0, f"{name}: the padded steps wrote the KV cache differently"
    assert res["agree"], f"{name}: greedy tokens differ"
    assert res["finite"], f"{name}: a padded row's hidden state is not finite"
    assert res["err"] < 1e-4, f"{name}: logits differ by {res['err']:.3e}"


if __name__ == "__main__":
    main()
