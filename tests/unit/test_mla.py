"""DeepSeek-V2/V3 pieces against their references: the grouped routers against
transformers' own router modules, YaRN's tables against transformers' YaRN, MLA's
absorbed decode form against the expanded form, the interleaved-rope permutation, and
the refusals of what MLA models do not run with yet."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from engine.attention.base import AttentionMetadata
from engine.distributed.tp_group import TPGroup
from engine.models.config import ModelArgs
from engine.models.deepseek_args import GroupedRouting, MLAArgs
from engine.models.deepseek_moe import RouterGate, grouped_route
from engine.models.deepseek_weights import interleaved_to_half
from engine.models.layer_ops import TorchOps
from engine.models.mla import MLAttention, store_latent
from engine.models.parallel import Shard
from engine.models.rope import RotaryEmbedding, rope_tables
from engine.models.support import check_mla_settings

YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "rope_theta": 10000.0,
}


def _hf_router(version: str, **cfg: object) -> torch.nn.Module:
    import transformers as tf

    base = {
        "hidden_size": 16,
        "num_attention_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
    }
    if version == "v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        return DeepseekV2TopkRouter(tf.DeepseekV2Config(**(base | cfg)))
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    return DeepseekV3TopkRouter(tf.DeepseekV3Config(**(base | cfg)))


def _sorted(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = experts.argsort(dim=-1)
    return weights.gather(1, order), experts.gather(1, order)


@pytest.mark.parametrize(
    ("version", "routing", "cfg"),
    [
        (
            "v2",
            GroupedRouting("softmax", 4, 2, "max", 1.5, 2),
            {
                "topk_method": "group_limited_greedy",
                "n_group": 4,
                "topk_group": 2,
                "routed_scaling_factor": 1.5,
            },
        ),
        ("v2", GroupedRouting("softmax", 1, 1, "max", 1.0, 2), {"topk_method": "greedy"}),
        (
            "v3",
            GroupedRouting("sigmoid", 4, 2, "top2", 2.5, 1),
            {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True},
        ),
    ],
)
def test_grouped_route_matches_transformers(version: str, routing: GroupedRouting, cfg) -> None:
    torch.manual_seed(0)
    hf = _hf_router(version, **cfg)
    with torch.no_grad():
        hf.weight.normal_()
        if version == "v3":
            hf.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(64, 16)
    _, want_w, want_e = hf(x)
    bias = hf.e_score_correction_bias if version == "v3" else None
    logits = torch.nn.functional.linear(x, hf.weight)
    got_w, got_e = grouped_route(logits, routing, 3, version == "v3", bias)
    got_w, got_e = _sorted(got_w, got_e)
    want_w, want_e = _sorted(want_w, want_e)
    assert torch.equal(got_e, want_e)
    torch.testing.assert_close(got_w, want_w)
    if routing.n_group > 1:  # the group limit changes choices on these inputs
        plain = GroupedRouting(routing.scoring, 1, 1, routing.group_score, 1.0, 0)
        assert not torch.equal(_sorted(*grouped_route(logits, plain, 3, False, bias))[1], got_e)


def test_router_gate_stays_float32() -> None:
    gate = RouterGate(16, 8, correction_bias=True)
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(torch.full((8,), 1.0 + 2**-20))  # type: ignore[union-attr]
    gate.to(dtype=torch.bfloat16)
    assert gate.weight.dtype == torch.float32
    assert gate.e_score_correction_bias is not None
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert float(gate.e_score_correction_bias.detach()[0]) == 1.0 + 2**-20


def test_yarn_tables_match_transformers() -> None:
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tf.DeepseekV2Config(
        qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=dict(YARN)
    )
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    positions = torch.arange(300, dtype=torch.float32)[:, None]
    emb = torch.cat((positions * inv_freq, positions * inv_freq), dim=-1)
    cos, sin = rope_tables(64, 300, 10000.0, YARN)
    torch.testing.assert_close(cos, emb.cos() * attention)
    torch.testing.assert_close(sin, emb.sin() * attention)
    assert attention == 1.0  # mscale == mscale_all_dim: the magnitudes cancel


def test_softmax_scale_takes_yarn_mscale() -> None:
    from transformers.modeling_rope_utils import yarn_apply_mscale

    cfg = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "rope_scaling": {k: v for k, v in YARN.items() if k != "rope_theta"} | {"type": "yarn"},
        "max_position_embeddings": 163840,
    }
    args = ModelArgs.from_hf(cfg)
    assert args.mla is not None and args.num_kv_heads == 1 and args.head_dim == 8
    assert args.kv_planes == 1 and args.kv_head_dim == 40
    assert args.mla.softmax_scale == pytest.approx(yarn_apply_mscale(YARN, 24**-0.5))
    assert args.mla.softmax_scale != pytest.approx(24**-0.5)


def test_interleaved_permutation_turns_pair_rope_into_rotate_half() -> None:
    """DeepSeek rotates pairs (x0, x1), (x2, x3)...; after the permutation the engine's
    rotate-half rope gives the same dot products."""
    torch.manual_seed(1)
    d, pos = 8, torch.tensor([5, 77])
    q, k = torch.randn(2, 1, d), torch.randn(2, 1, d)
    cos, sin = rope_tables(d, 100, 10000.0, {})
    half = cos[pos][:, None, : d // 2], sin[pos][:, None, : d // 2]

    def pairs(x: torch.Tensor) -> torch.Tensor:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.cat((a * half[0] - b * half[1], b * half[0] + a * half[1]), dim=-1)

    want = (pairs(q) * pairs(k)).sum(-1)
    qp, kp = (interleaved_to_half(t.squeeze(1).T, d).T.unsqueeze(1) for t in (q, k))
    qr, kr = TorchOps.rope(pos, qp, kp, cos, sin)
    torch.testing.assert_close((qr * kr).sum(-1), want)


def _mla_layer() -> tuple[MLAttention, MLAArgs]:
    m = MLAArgs(48, 32, 16, 8, 16, (24) ** -0.5)
    args = ModelArgs(
        architecture="DeepseekV3ForCausalLM",
        vocab_size=10,
        hidden_size=64,
        intermediate_size=1,
        num_layers=1,
        num_heads=4,
        num_kv_heads=1,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        mla=m,
    )
    torch.manual_seed(2)
    layer = MLAttention(Shard(args), RotaryEmbedding(8, 256, 10000.0, {}), TPGroup.single())
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    return layer, m


def _meta(lens: list[int], new: list[int], block_size: int, width: int) -> AttentionMetadata:
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    tables = torch.tensor([[i * width + j for j in range(width)] for i in range(len(lens))])
    slots = [
        int(tables[i, p // block_size]) * block_size + p % block_size
        for i, (length, n) in enumerate(zip(lens, new, strict=True))
        for p in range(length - n, length)
    ]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(lens),
        block_tables=tables.int(),
        max_query_len=max(new),
        max_seq_len=max(lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )


def test_absorbed_decode_equals_expanded_prefill() -> None:
    """Two requests prefill (expanded form); then one decode token each, once through the
    padded batch (absorbed, what a graph captures) and once as the last row of a longer
    prefill over the same context (expanded): equal outputs."""
    layer, m = _mla_layer()
    bs, width = 4, 8
    cache = torch.zeros(1, 2 * width, bs, 1, m.latent_dim)
    x = torch.randn(2, 20, 64)
    lens = [13, 20]
    with torch.no_grad():
        for i, n in enumerate(lens):
            meta = _meta([n - 1], [n - 1], bs, width)
            meta.block_tables = meta.block_tables + i * width
            meta.slot_mapping = meta.slot_mapping + i * width * bs
            layer(x[i, : n - 1], torch.arange(n - 1), cache, meta)
        decode = _meta(lens, [1, 1], bs, width)
        rows = torch.stack([x[0, 12], x[1, 19]])
        got = layer(rows, torch.tensor([12, 19]), cache.clone(), decode)
        for i, n in enumerate(lens):
            full = _meta([n], [n], bs, width)
            fresh = torch.zeros_like(cache)
            want = layer(x[i, :n], torch.arange(n), fresh, full)[-1]
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-5)


def test_store_latent_skips_negative_slots() -> None:
    cache = torch.zeros(1, 2, 4, 1, 3)
    store_latent(cache, torch.ones(3, 3), torch.tensor([1, -1, 6]))
    assert cache.view(-1, 3).sum(-1).tolist() == [0, 3, 0, 0, 0, 0, 3, 0]
    with pytest.raises(ValueError, match="not an MLA latent cache"):
        store_latent(torch.zeros(2, 2, 4, 1, 3), torch.ones(1, 3), torch.tensor([0]))


def _config(arch: str, **kw: object) -> SimpleNamespace:
    base = {
        "tensor_parallel_size": 1,
        "kv_cache_dtype": "auto",
        "quantization": None,
        "enable_lora": False,
        "deterministic": False,
    }
    return SimpleNamespace(hf_config=lambda: {"architectures": [arch]}, **(base | kw))


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("tensor_parallel_size", 2),
        ("kv_cache_dtype", "fp8"),
        ("quantization", "fp8"),
        ("enable_lora", True),
        ("deterministic", True),
    ],
)
def test_mla_refuses_what_it_does_not_run(setting: str, value: object) -> None:
    check_mla_settings(_config("DeepseekV3ForCausalLM"))
    check_mla_settings(_config("LlamaForCausalLM", **{setting: value}))
    with pytest.raises(ValueError, match=f"multi-head latent attention.*{setting.split('_')[0]}"):
        check_mla_settings(_config("DeepseekV2ForCausalLM", **{setting: value}))


def test_unsupported_routing_is_refused() -> None:
    from engine.models.deepseek_args import deepseek_fields

    cfg = {
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "kv_lora_rank": 32,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "topk_method": "noaux_tc",
        "scoring_func": "softmax",
    }
    with pytest.raises(ValueError, match="not supported"):
        deepseek_fields("DeepseekV3ForCausalLM", cfg, 2, {})
    assert math.isfinite(
        deepseek_fields("DeepseekV3ForCausalLM", cfg | {"scoring_func": "sigmoid"}, 2, {})[
            "mla"
        ].softmax_scale
    )
