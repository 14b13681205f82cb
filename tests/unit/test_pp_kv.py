"""KV records and handles of pipeline-parallel engines (docs/design.md §3, "KV with pipeline
parallelism"): the fingerprint names P (and N), each grid process keys its records under its
own rank, the engine process's layout holds stage 0's layers only, and a handle of another
P or N is refused naming both sizes and the flag (the handoff between real services is
``tests/integration/test_pp_pd.py``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.config import EngineConfig
from engine.kv.fingerprint import (
    kv_layout,
    model_fingerprint,
    pipeline_parallel_size_of,
    tensor_parallel_size_of,
)
from engine.models import ModelArgs
from kv_store.base import rank_fingerprint
from pdserve_api.v1 import pdserve_pb2 as pb
from service.convert import check_handle_compatible, kv_handle_fields, remote_kv_from_handle
from service.errors import IncompatibleKvHandle


def _config(model: Path, pp: int = 1, tp: int = 1) -> EngineConfig:
    return EngineConfig(model=str(model), pipeline_parallel_size=pp, tensor_parallel_size=tp)


def test_fingerprints_name_p_and_n(tiny_model_dir: Path) -> None:
    prints = {
        (pp, tp): model_fingerprint(_config(tiny_model_dir, pp, tp))
        for pp, tp in ((1, 1), (2, 1), (1, 2), (2, 2))
    }
    assert prints[(2, 1)].endswith("-pp2") and prints[(2, 2)].endswith("-pp2-tp2")
    # One model: the hash part is shared (a decode of another split re-cuts the blocks);
    # the suffixes, and so every store key, differ.
    assert len({fp[:32] for fp in prints.values()}) == 1 and len(set(prints.values())) == 4
    for (pp, tp), fp in prints.items():
        assert (pipeline_parallel_size_of(fp), tensor_parallel_size_of(fp)) == (pp, tp)
    # Grid process g (stage g // N, TP rank g % N) keys its records under its own rank.
    grid = prints[(2, 2)]
    assert [rank_fingerprint(grid, g, 4) for g in range(4)] == [f"{grid}-r{g}" for g in range(4)]


def test_the_engine_layout_holds_stage_0s_layers(tiny_model_dir: Path) -> None:
    args = ModelArgs.from_hf(_config(tiny_model_dir).hf_config())
    whole = kv_layout(_config(tiny_model_dir), args, args.num_kv_heads)
    staged = kv_layout(_config(tiny_model_dir, pp=2), args, args.num_kv_heads)
    assert whole.num_layers == args.num_layers == 2
    assert staged.num_layers == 1  # stage 0's half: its records say so, a load checks it


def _engine(model: Path, pp: int, tp: int) -> SimpleNamespace:
    config = _config(model, pp, tp)
    args = ModelArgs.from_hf(config.hf_config())
    heads = max(1, args.num_kv_heads // tp)
    return SimpleNamespace(
        model_fingerprint=model_fingerprint(config),
        kv_layout=kv_layout(config, args, heads),
        config=config,
        args=args,
    )


@pytest.mark.parametrize(
    ("theirs", "mine"), [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 1), (1, 2)), ((1, 2), (1, 1))]
)
def test_a_handle_of_another_grid_is_recut(
    tiny_model_dir: Path, theirs: tuple[int, int], mine: tuple[int, int]
) -> None:
    """Same model, another split: taken, and the load carries the re-cut (docs/design.md
    §3 "KV between unlike grids"); its own grid's handle carries none."""
    prefill = _engine(tiny_model_dir, *theirs)
    handle = pb.KvHandle(
        **kv_handle_fields(prefill), num_tokens=16, block_keys=["k"], connector="fs"
    )
    check_handle_compatible(handle, prefill)
    assert remote_kv_from_handle(handle, 16, prefill).reshard is None
    decode = _engine(tiny_model_dir, *mine)
    check_handle_compatible(handle, decode)
    reshard = remote_kv_from_handle(handle, 16, decode).reshard
    assert reshard is not None and reshard["source_fingerprint"] == handle.model_fingerprint
    assert len(reshard["sources"]) == theirs[0] * theirs[1]
    assert len(reshard["dests"]) == mine[0] * mine[1]


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("model_fingerprint", "0" * 32 + "-pp2", "another model, weights, dtype or block size"),
        ("connector", "lmcache", "the 'lmcache' connector cannot move KV between unlike grids"),
        ("dtype", "bfloat16", "dtype 'bfloat16' != 'float32'"),
    ],
)
def test_a_handle_that_cannot_be_recut_is_refused(
    tiny_model_dir: Path, field: str, value: str, says: str
) -> None:
    handle = pb.KvHandle(
        **kv_handle_fields(_engine(tiny_model_dir, 2, 1)),
        num_tokens=16,
        block_keys=["k"],
        connector="fs",
    )
    setattr(handle, field, value)
    with pytest.raises(IncompatibleKvHandle) as refused:
        check_handle_compatible(handle, _engine(tiny_model_dir, 1, 1))
    message = str(refused.value)
    assert says in message, message
    if field != "dtype":  # both grids named
        assert "pipeline_parallel_size 2 x tensor_parallel_size 1 (prefill)" in message
        assert "pipeline_parallel_size 1 x tensor_parallel_size 1 (this decode)" in message
