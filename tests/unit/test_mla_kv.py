"""The MLA latent cache's records and refusals: a one-plane block round-trips through the
record codec and the fs scatter/gather path; a reader of per-head K/V refuses a latent
record (and the other way round) naming both kinds; a p2p peer and a decode instance
refuse the other kind by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.kv.fingerprint import kv_kind_of
from kv_store.base import KvLayout
from kv_store.p2p.server import _layout_refusal
from kv_store.record import (
    RecordLayoutError,
    block_parts,
    cache_numpy,
    check_record_parts,
    decode_block,
    encode_block,
    record_header,
    record_size,
)
from pdserve_api.v1 import pdserve_pb2 as pb
from service.convert import check_handle_compatible, kv_handle_fields
from service.errors import IncompatibleKvHandle

# DeepSeek-V2-Lite's latent (512 + 64) over 3 layers, and a K/V layout of equal bytes.
MLA = KvLayout(1, "bfloat16", 4, 3, 1, 576, planes=1)
KV = KvLayout(1, "bfloat16", 4, 3, 2, 144)


def _latent_cache(blocks: int = 3) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(3, 1, blocks, 4, 1, 576).to(torch.bfloat16)


def test_latent_block_round_trips() -> None:
    kv = _latent_cache()
    rec = encode_block(kv[:, :, 1, :3], MLA)
    assert len(rec) == record_size(MLA, 3) == 64 + 3 * 3 * 576 * 2
    assert torch.equal(decode_block(rec, MLA, expected_tokens=3), kv[:, :, 1, :3])


def test_latent_block_parts_round_trip() -> None:
    """The fs fast path: one piece per layer (one plane), read back into another block."""
    kv = _latent_cache()
    parts = block_parts(cache_numpy(kv), 2, 4)  # type: ignore[arg-type]
    assert len(parts) == 3
    head = record_header(MLA, 4, parts)
    check_record_parts(head, parts, MLA, 4)
    rec = head + b"".join(bytes(p) for p in parts)
    assert torch.equal(decode_block(rec, MLA, expected_tokens=4), kv[:, :, 2])


def test_kv_reader_refuses_a_latent_record_by_kind() -> None:
    latent = encode_block(_latent_cache()[:, :, 0], MLA)
    with pytest.raises(RecordLayoutError, match="MLA latent cache, the reader a per-head K/V"):
        decode_block(latent, KV)
    pair = encode_block(torch.zeros(3, 2, 4, 2, 144, dtype=torch.bfloat16), KV)
    assert len(pair) == len(latent)  # same bytes: only the kind tells them apart
    with pytest.raises(RecordLayoutError, match="per-head K/V cache, the reader a MLA latent"):
        decode_block(pair, MLA)


def test_p2p_hello_refusal_names_the_kinds() -> None:
    mine = {"version": 1, "dtype": "bfloat16", "num_kv_heads": 1, "head_dim": 576, "planes": 1}
    theirs = {"version": 1, "dtype": "bfloat16", "num_kv_heads": 2, "head_dim": 144}
    assert "it holds a per-head K/V cache, this instance an MLA latent cache" in (
        _layout_refusal(theirs, mine)
    )
    assert _layout_refusal(theirs | {"head_dim": 64}, theirs) == (
        "the peer runs a different model or KV layout"
    )


def test_decode_instance_refuses_a_latent_handle_by_kind() -> None:
    grid = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1)
    llama = SimpleNamespace(model_fingerprint="a" * 32, kv_layout=KV, config=grid, args=None)
    deepseek = SimpleNamespace(
        model_fingerprint="b" * 32 + "-mla", kv_layout=MLA, config=grid, args=None
    )
    assert kv_kind_of(deepseek.model_fingerprint) == "MLA latent"
    assert kv_kind_of("c" * 32 + "-mla-tp2") == "MLA latent"
    assert kv_kind_of(llama.model_fingerprint + "-tp2") == "per-head K/V"
    handle = pb.KvHandle(**kv_handle_fields(deepseek), block_keys=["k"], num_tokens=4)
    with pytest.raises(IncompatibleKvHandle, match=r"KV cache kind MLA latent \(prefill\) "):
        check_handle_compatible(handle, llama)
    check_handle_compatible(handle, deepseek)
