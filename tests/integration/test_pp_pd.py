"""Prefill → decode between pipeline-parallel instances (P = 2 on both sides; CPU, gloo,
real services whose stages are real processes): every process of the P × N grid moves its
own KV (its stage's layers of its TP rank's heads) to the same process on the other side,
over the fs store (per-process records) and over p2p (process-to-process pulls). Greedy
tokens equal those of the offline engine (P = 1, in this process) and of a P = 1 service
computing the prompt itself. Between unlike grids (docs/design.md §3 "KV between unlike
grids") a P = 1 decode loads a P = 2 prefill's blocks (2 -> 1) and a P = 2 decode a P = 1
prefill's (1 -> 2), each process taking the layers it owns.

Each connector gets one stack for the module (prefill P = 2, decode P = 2, decode P = 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.router_support import wait_for
from tests.integration.test_p2p_services import decode, free_blocks, prefill_handle
from tests.integration.test_tp_pd import THIRD, Stack, parallel_stack, recut

pytestmark = pytest.mark.timeout(900)
PP2 = ("--pipeline-parallel-size", "2")
PROMPT = [2000 + (i * 31) % 20000 for i in range(45)]  # 2 full blocks + a partial one
OTHER = [3000 + (i * 17) % 20000 for i in range(40)]


@pytest.fixture(scope="module")
def fs_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    yield from parallel_stack(
        tmp_path_factory, tiny_model_dir, ("--connector", "fs", "--kv-path", "{kv}"), PP2
    )


@pytest.fixture(scope="module")
def p2p_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    yield from parallel_stack(
        tmp_path_factory, tiny_model_dir, ("--connector", "p2p", "--p2p-timeout", "20"), PP2
    )


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> Iterator[object]:
    from engine.llm import LLM

    with LLM(str(tiny_model_dir), num_kv_blocks=64) as llm:  # P = 1, in this process
        yield llm


def _offline_tokens(llm: object, prompt: list[int], n: int) -> list[int]:
    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return list(llm.generate(prompt, params)[0].token_ids)  # type: ignore[attr-defined]


def test_fs_per_stage_records_match_the_offline_engine(fs_stack: Stack, offline: object) -> None:
    first, handle = prefill_handle(fs_stack.prefill, "p1", PROMPT)
    assert handle.model_fingerprint.endswith("-pp2") and handle.num_tokens == len(PROMPT)
    for rank in (0, 1):  # one record per block per stage, under the stage's own fingerprint
        records = (fs_stack.kv_dir / "pdserve" / f"{handle.model_fingerprint}-r{rank}").rglob("*")
        assert sum(p.is_file() for p in records) == 3, rank

    tokens, timings = decode(fs_stack.decode, PROMPT, first, handle)
    assert timings.kv_blocks_loaded == 3 and timings.kv_blocks_recomputed == 0
    assert tokens == _offline_tokens(offline, PROMPT, len(tokens))
    assert recut(fs_stack.single, handle, first, PROMPT) == tokens  # 2 -> 1
    colocated, _ = decode(fs_stack.single, PROMPT, None, None)
    assert tokens == colocated


def test_fs_p1_prefill_to_p2_decode(fs_stack: Stack, offline: object) -> None:
    first, handle = prefill_handle(fs_stack.single_prefill, "p3", THIRD)
    tokens = recut(fs_stack.decode, handle, first, THIRD)  # 1 -> 2
    assert tokens == _offline_tokens(offline, THIRD, len(tokens))


def test_fs_layers_missing_on_one_stage_are_recomputed(fs_stack: Stack, offline: object) -> None:
    first, handle = prefill_handle(fs_stack.prefill, "p2", OTHER)
    last = handle.block_keys[-1].rsplit("/", 1)[1]
    stage1 = fs_stack.kv_dir / "pdserve" / f"{handle.model_fingerprint}-r1"
    next(p for p in stage1.rglob(last) if p.is_file()).unlink()  # stage 0 still has it

    tokens, timings = decode(fs_stack.decode, OTHER, first, handle)
    assert timings.kv_blocks_loaded == 2 and timings.kv_blocks_recomputed == 1
    assert tokens == _offline_tokens(offline, OTHER, len(tokens))


def test_p2p_stage_to_stage_matches_the_offline_engine(p2p_stack: Stack, offline: object) -> None:
    first, handle = prefill_handle(p2p_stack.prefill, "p1", PROMPT)
    assert handle.model_fingerprint.endswith("-pp2")
    sources, transfers = handle.source_address.split(","), handle.transfer_id.split(",")
    assert len(sources) == 2 and len(set(sources)) == 2, handle.source_address
    assert len(transfers) == 2 and all(t.startswith("p1.") for t in transfers)
    free, total = free_blocks(p2p_stack.prefill)
    assert free < total  # held on every stage for the pull

    tokens, timings = decode(p2p_stack.decode, PROMPT, first, handle)
    assert timings.kv_blocks_loaded == 3 and timings.kv_blocks_recomputed == 0
    assert tokens == _offline_tokens(offline, PROMPT, len(tokens))
    colocated, _ = decode(p2p_stack.single, PROMPT, None, None)
    assert tokens == colocated
    wait_for(lambda: free_blocks(p2p_stack.prefill)[0] == total, 20, "the held blocks freed")


def test_p2p_p2_prefill_to_p1_decode(p2p_stack: Stack, offline: object) -> None:
    """2 -> 1: the P = 1 decode pulls both stages' leases, each its layers."""
    first, handle = prefill_handle(p2p_stack.prefill, "p5", THIRD)
    _, total = free_blocks(p2p_stack.prefill)
    tokens = recut(p2p_stack.single, handle, first, THIRD)
    assert tokens == _offline_tokens(offline, THIRD, len(tokens))
    wait_for(lambda: free_blocks(p2p_stack.prefill)[0] == total, 20, "both leases pulled")
