"""FP8 (e4m3) KV cache on the CPU (torch path): accuracy against the model-dtype cache on
the tiny random Llama, cache sizing, records, the P/D handoff over ``fs`` and the refusal
of a handle between different KV dtypes (docs/design.md §3 "KV cache dtype").

Accuracy is measured teacher-forced: both engines see the same token sequence (the
float32 engine's greedy output), prefilled in two chunks (the second reads the first from
the cache) and then decoded one token at a time, so every position's logits come from K/V
read back out of the paged cache. A random model's logits are nearly flat, so a greedy
flip is expected where the top two are closer than the fp8 error; a flip with a wider
margin than twice the measured error would be a bug, and none is allowed.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.request import RemoteKV
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from kv_store.base import KvLayout
from kv_store.factory import KVStoreSettings, build_connector
from kv_store.record import RecordLayoutError, decode_block, encode_block
from tests.engine_flag_support import check_engine_flag
from tests.unit.kv_fp8_support import check_agreement, compare, run_sequence

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = list(range(300, 345))  # 2 full blocks + a partial tail


def _engine(model: Path, kv: str, connector_settings: dict | None = None, **kw) -> LLMEngine:
    connector = (
        build_connector(KVStoreSettings(**connector_settings)) if connector_settings else None
    )
    return LLMEngine(EngineConfig(model=str(model), kv_cache_dtype=kv, **kw), connector)


def _generate(
    engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY, **kw
) -> list[int]:
    engine.add_request("r", prompt, params, **kw)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens += out.new_token_ids
    return tokens


def test_fp8_logits_and_greedy_agreement_on_tiny_llama(tiny_model_dir: Path) -> None:
    ref = _engine(tiny_model_dir, "auto", num_kv_blocks=64)
    fp8 = _engine(tiny_model_dir, "fp8", num_kv_blocks=64)
    assert fp8.runner.kv_cache.dtype == torch.float8_e4m3fn
    rng = random.Random(0)
    results = []
    for _ in range(6):
        prompt = [rng.randrange(300, 40000) for _ in range(40)]
        out = _generate(
            ref, prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        )
        seq = prompt + out[:-1]
        a = run_sequence(ref.runner, seq, [17, 23])
        b = run_sequence(fp8.runner, seq, [17, 23])
        # The helper reproduces the engine: its float32 argmax is the engine's greedy output.
        assert a.argmax(1).tolist() == out
        results.append(compare(a, b))
    # Measured here: top-1 141/144 (0.979), rms dlogit 0.0020 and max 0.0107 against a
    # logit std of 0.159.
    check_agreement(results, "float32", rms_frac=0.05, max_frac=0.25)


def test_fp8_cache_fits_twice_the_blocks(tiny_model_dir: Path) -> None:
    budget = 1 << 20
    auto = _engine(tiny_model_dir, "auto", dtype="bfloat16", kv_cache_memory=budget)
    fp8 = _engine(tiny_model_dir, "fp8", dtype="bfloat16", kv_cache_memory=budget)
    assert fp8.runner.bytes_per_block() * 2 == auto.runner.bytes_per_block()
    assert fp8.runner.num_blocks == 2 * auto.runner.num_blocks
    assert fp8.kv_layout.dtype == "float8_e4m3fn" and auto.kv_layout.dtype == "bfloat16"
    assert fp8.model_fingerprint != auto.model_fingerprint  # other bytes: other store keys


def test_bad_kv_cache_dtype_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="int8")


def test_fp8_record_roundtrip_and_dtype_mismatch() -> None:
    fp8 = KvLayout(1, "float8_e4m3fn", 16, 2, 2, 16)
    block = torch.randn(2, 2, 11, 2, 16).to(torch.float8_e4m3fn)
    record = encode_block(block, fp8)
    bf16_record = encode_block(block.to(torch.bfloat16), KvLayout(1, "bfloat16", 16, 2, 2, 16))
    assert len(record) - 64 == block.numel() and len(bf16_record) - 64 == 2 * block.numel()
    back = decode_block(record, fp8)
    assert torch.equal(back.view(torch.uint8), block.view(torch.uint8))
    with pytest.raises(RecordLayoutError, match="float8_e4m3fn"):
        decode_block(record, KvLayout(1, "bfloat16", 16, 2, 2, 16))


def test_fp8_handoff_over_fs_is_identical_to_colocated_fp8(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = {"connector": "fs", "kv_path": str(tmp_path / "kv")}
    producer = _engine(tiny_model_dir, "fp8", settings, num_kv_blocks=128)
    producer.add_request("p", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), save_kv=True)
    first, saved = -1, None
    while producer.has_unfinished():
        for out in producer.step():
            first = out.new_token_ids[0] if out.new_token_ids else first
            saved = out.kv_saved or saved
    assert saved is not None and len(saved.block_keys) == 3
    files = [p for p in (tmp_path / "kv").rglob("*") if p.is_file()]
    # Payload bytes: layers x (K, V) x tokens x kv heads x head dim, one byte each.
    assert sum(p.stat().st_size - 64 for p in files) == 2 * 2 * len(PROMPT) * 2 * 16

    consumer = _engine(tiny_model_dir, "fp8", settings, num_kv_blocks=128)
    tokens = [first] + _generate(
        consumer, PROMPT, output_token_ids=[first], remote_kv=RemoteKV([], len(PROMPT))
    )
    assert consumer.transfers is not None
    assert consumer.transfers.stats.blocks_loaded == 3
    assert consumer.transfers.stats.blocks_recomputed == 0
    colocated = _generate(_engine(tiny_model_dir, "fp8", num_kv_blocks=128), PROMPT)
    assert tokens[: len(colocated)] == colocated

    # A float32-KV decode instance refuses the fp8 prefill's handle, naming the dtype.
    from service.convert import check_handle_compatible, kv_handle
    from service.errors import IncompatibleKvHandle

    handle = kv_handle(producer, saved, "fs")
    assert handle.dtype == "float8_e4m3fn"
    mismatched = _engine(tiny_model_dir, "auto", num_kv_blocks=16)
    with pytest.raises(IncompatibleKvHandle, match="dtype 'float8_e4m3fn' != 'float32'"):
        check_handle_compatible(handle, mismatched)
    check_handle_compatible(handle, consumer)  # the same KV dtype passes


def test_kv_cache_dtype_flag_reaches_the_engine_and_up_forwards_it(tiny_model_dir: Path) -> None:
    check_engine_flag(tiny_model_dir, "--kv-cache-dtype", "fp8", "kv_cache_dtype", "auto", "int8")
