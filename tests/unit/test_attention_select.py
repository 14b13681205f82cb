"""Backend selection (engine/attention/__init__.py) and the flash_attn step-shape table
(engine/attention/flash_attn.py), on the CPU: no GPU and no flash-attn package needed."""

from __future__ import annotations

import pytest
import torch

from engine.attention import get_backend
from engine.attention.base import AttentionMetadata
from engine.attention.flash_attn import SHAPE_TABLE, step_shape, table_winner


def _meta(q_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros((len(q_lens), 1), dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )


@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "shape"),
    [
        ([1] * 64, [2048] * 64, "decode"),
        ([2048], [2048], "prefill"),
        ([512] * 4, [2048] * 4, "chunked_prefill"),
        ([512], [1000], "prefill"),  # less cached context than queries
        ([512], [1024], "chunked_prefill"),
        ([2048], [8192], "long_chunked_prefill"),
        ([512], [4608], "long_chunked_prefill"),  # 4096 cached: the threshold
        ([512], [4607], "chunked_prefill"),
    ],
)
def test_step_shape(q_lens: list[int], seq_lens: list[int], shape: str) -> None:
    assert step_shape(_meta(q_lens, seq_lens)) == shape


def test_table_covers_every_shape_once() -> None:
    shapes = ["chunked_prefill", "decode", "long_chunked_prefill", "prefill"]
    assert sorted(r.shape for r in SHAPE_TABLE) == shapes
    assert table_winner("long_chunked_prefill") == "flash_attn"  # 1.62x / 1.69x on the H200
    # FA4 won these in one run and lost in the other: Triton, the kernel that never lost.
    assert table_winner("chunked_prefill") == "triton"
    assert table_winner("prefill") == "triton"
    assert table_winner("decode") == "triton"
    with pytest.raises(ValueError, match="no measured row"):
        table_winner("sideways")


def test_selection_errors_on_cpu() -> None:
    assert get_backend("auto", "cpu").name == "torch_ref"
    with pytest.raises(ValueError, match="needs device 'cuda'"):
        get_backend("flash_attn", "cpu")
    with pytest.raises(ValueError, match="must be one of"):
        get_backend("flash-attention", "cpu")


def test_flash_attn_without_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA without the package: an error naming the install, not an ImportError."""
    import engine.attention.flash_attn as fa

    monkeypatch.setattr(fa, "fa4_available", lambda: False)
    with pytest.raises(ValueError, match=r"pdserve\[flash-attn\]"):
        fa.check_flash_attn_usable("cuda")
