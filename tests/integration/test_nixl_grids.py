"""Prefill → decode over ``--connector nixl`` between unlike grids (docs/design.md §3 "KV
between unlike grids"; CPU: DRAM pools, UCX, real services whose tensor-parallel ranks and
pipeline stages are real processes over gloo). Each decode process READs the layers and
heads it owns from the prefill processes that hold them (``kv_store/nixl/recut.py``):

- tensor parallel 2 → 1: the decode reads both prefill ranks' leases and joins their heads;
- tensor parallel 1 → 2: both decode ranks read the one lease (each its heads), which ends
  after both;
- pipeline parallel 2 → 1: the decode reads each stage's layers straight into its blocks.

Greedy tokens equal a tensor- and pipeline-parallel size 1 decode computing the prompt
itself; every block arrives by READ (none recomputed), and every held block returns to its
prefill's pool. One stack of five services for the module (starting them is the slow part).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.router_support import wait_for
from tests.integration.test_nixl_services import all_free
from tests.integration.test_p2p_services import free_blocks, prefill_handle
from tests.integration.test_tp_pd import recut
from tests.service_fixtures import ProcessStack, ServiceProcess

pytestmark = pytest.mark.timeout(900)
NIXL = ("--connector", "nixl", "--p2p-timeout", "20")
TP2 = ("--tensor-parallel-size", "2")
PP2 = ("--pipeline-parallel-size", "2")
TP_2_TO_1 = [2000 + (i * 31) % 20000 for i in range(45)]  # 2 full blocks + a partial one
TP_1_TO_2 = [3000 + (i * 17) % 20000 for i in range(40)]  # no block shared with the others
PP_2_TO_1 = [4000 + (i * 13) % 20000 for i in range(40)]


@dataclass(slots=True)
class Grids:
    prefill_tp2: ServiceProcess
    prefill_pp2: ServiceProcess
    prefill: ServiceProcess  # 1 x 1
    decode_tp2: ServiceProcess
    decode: ServiceProcess  # 1 x 1: the reference too


@pytest.fixture(scope="module")
def grids(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Grids]:
    stack = ProcessStack(tmp_path_factory.mktemp("nixl_grids") / "logs", tiny_model_dir)
    try:
        services = stack.together(
            lambda: stack.service("prefill", connector_args=NIXL, extra_args=TP2),
            lambda: stack.service("prefill", connector_args=NIXL, extra_args=PP2),
            lambda: stack.service("prefill", connector_args=NIXL),
            lambda: stack.service("decode", connector_args=NIXL, extra_args=TP2),
            lambda: stack.service("decode", connector_args=NIXL),
        )
        yield Grids(*services)
    finally:
        stack.close()


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> Iterator[object]:
    from engine.llm import LLM

    with LLM(str(tiny_model_dir), num_kv_blocks=64) as llm:  # 1 x 1, in this process
        yield llm


def _handoff(
    prefill: ServiceProcess, target: ServiceProcess, offline: object, prompt: list[int],
    sources: int,
) -> None:  # fmt: skip
    """``prompt`` prefilled on ``prefill`` (``sources`` processes) and re-cut into
    ``target``: the offline engine's greedy tokens; every lease ends, its blocks back in the
    prefill's pool."""
    from engine.core.sampling_params import SamplingParams

    _, total = free_blocks(prefill)
    first, handle = prefill_handle(prefill, f"r{prompt[0]}", prompt)
    assert handle.connector == "nixl" and handle.source_address.startswith("nixl:")
    assert len(handle.source_address.split(",")) == sources  # a card per prefill process
    tokens = recut(target, handle, first, prompt)  # every block read, none recomputed
    params = SamplingParams(max_tokens=len(tokens), temperature=0.0, ignore_eos=True)
    reference = offline.generate(prompt, params)[0].token_ids  # type: ignore[attr-defined]
    assert tokens == list(reference)
    wait_for(lambda: free_blocks(prefill)[0] == total, 20, "every lease ended as pulled")
    assert all_free(target)


def test_tp2_prefill_to_tp1_decode(grids: Grids, offline: object) -> None:
    _handoff(grids.prefill_tp2, grids.decode, offline, TP_2_TO_1, 2)


def test_tp1_prefill_to_tp2_decode(grids: Grids, offline: object) -> None:
    _handoff(grids.prefill, grids.decode_tp2, offline, TP_1_TO_2, 1)


def test_pp2_prefill_to_pp1_decode(grids: Grids, offline: object) -> None:
    _handoff(grids.prefill_pp2, grids.decode, offline, PP_2_TO_1, 2)
