"""Tensor-parallel pieces without processes: which heads, columns and vocab rows each rank
holds (``Shard``), and the step inputs' header + packed buffer round trip (``step_wire``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.executor.step_inputs import HostInputs
from engine.executor.tp.step_wire import OP_SHUTDOWN, Header, pack, unpack
from engine.models.config import ModelArgs
from engine.models.parallel import Shard, check_tensor_parallel

ARGS = ModelArgs(
    architecture="LlamaForCausalLM",
    vocab_size=11,
    hidden_size=8,
    intermediate_size=12,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def test_kv_heads_split_or_replicated() -> None:
    assert [(Shard(ARGS, r, 2).kv_head_start, Shard(ARGS, r, 2).num_kv_heads) for r in (0, 1)] == [
        (0, 1),
        (1, 1),
    ]
    # 4 ranks over 2 KV heads: ranks 0-1 attend with head 0, ranks 2-3 with head 1.
    assert [Shard(ARGS, r, 4).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    one_kv = dataclasses.replace(ARGS, num_kv_heads=1)
    assert [Shard(one_kv, r, 4).kv_head_start for r in range(4)] == [0, 0, 0, 0]


def test_vocab_slices_cover_the_vocabulary_once() -> None:
    shards = [Shard(ARGS, r, 2) for r in (0, 1)]
    assert [s.vocab_range for s in shards] == [(0, 6), (6, 11)]
    assert all(s.vocab_per_rank == 6 for s in shards)


def test_checkpoint_slices() -> None:
    s = Shard(ARGS, 1, 2)
    q = torch.arange(8 * 8).view(8, 8)  # 4 heads x head_dim 2 rows
    assert torch.equal(s.slice_checkpoint("layers.0.self_attn.q_proj.weight", q), q[4:8])
    k = torch.arange(4 * 8).view(4, 8)
    assert torch.equal(s.slice_checkpoint("layers.0.self_attn.k_proj.weight", k), k[2:4])
    o = torch.arange(8 * 8).view(8, 8)
    assert torch.equal(s.slice_checkpoint("layers.0.self_attn.o_proj.weight", o), o[:, 4:8])
    down = torch.arange(8 * 12).view(8, 12)
    assert torch.equal(s.slice_checkpoint("layers.0.mlp.down_proj.weight", down), down[:, 6:])
    emb = torch.arange(11 * 8).view(11, 8)
    assert torch.equal(s.slice_checkpoint("embed_tokens.weight", emb), emb[6:])
    norm = torch.ones(8)
    assert s.slice_checkpoint("layers.0.input_layernorm.weight", norm) is norm


def test_sizes_that_do_not_divide_are_named() -> None:
    check_tensor_parallel(ARGS, 4)  # 4 heads, KV heads replicated twice, 12 % 4 == 0
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible") as e:
        check_tensor_parallel(ARGS, 3)
    assert "intermediate_size 12" not in str(e.value)  # 12 % 3 == 0
    with pytest.raises(ValueError, match="num_key_value_heads 3 is not divisible"):
        check_tensor_parallel(dataclasses.replace(ARGS, num_heads=6, num_kv_heads=3), 2)


def _host(ids: list[int]) -> HostInputs:
    tables = np.array([[3, 4, 0], [7, 0, 0]], dtype=np.int32)
    return HostInputs(
        np.array(ids, dtype=np.int64),
        np.array([0, 1, 2, 5], dtype=np.int64),
        np.array([48, 49, 50, 117], dtype=np.int64),
        np.array([2, 3], dtype=np.int64),
        np.array([0, 3, 4], dtype=np.int32),
        np.array([3, 6], dtype=np.int32),
        tables,
        3,
        [0, 3, 4],
        [3, 6],
    )


@pytest.mark.parametrize("ids", [[9, 8, 7, 6], []])
def test_step_inputs_round_trip(ids: list[int]) -> None:
    host = _host(ids)
    header, buffer = pack(host, ids_on_device=not ids)
    again = Header.decode(header.encode())
    assert again == header and len(header.encode()) == 80
    got = unpack(again, buffer.copy())
    for field in dataclasses.fields(HostInputs):
        a, b = getattr(got, field.name), getattr(host, field.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), field.name
        else:
            assert a == b, field.name


def test_header_rejects_garbage() -> None:
    assert Header.decode(Header(OP_SHUTDOWN).encode()).op == OP_SHUTDOWN
    with pytest.raises(ValueError, match="not a step header"):
        Header.decode(b"\x07" * 80)
    with pytest.raises(ValueError, match="80 bytes"):
        Header.decode(b"\x00" * 10)


def test_fingerprint_tells_tensor_parallel_sizes_apart(tiny_model_dir: Path) -> None:
    from engine.config import EngineConfig
    from engine.kv.fingerprint import model_fingerprint

    one = model_fingerprint(EngineConfig(model=str(tiny_model_dir)))
    two = model_fingerprint(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2))
    assert one != two
