"""P/D between unlike grids through the router (docs/design.md §3 "KV between unlike
grids"), with the real ``openai`` client: greedy text equals the offline engine's (one
process, N = P = 1) when

- a tiny Qwen3-MoE prefill of tensor-parallel size 1 hands off over p2p to a decode of
  size 2 (both decode ranks pull the one lease, each its KV heads), and
- SmolLM2-135M prefills as a 2-stage pipeline and hands off over fs to a decode of one
  stage (it reads both stages' records, each its layers), and
- the tiny Qwen3-MoE prefills with tensor-parallel size 2 and hands off over nixl to a
  decode of size 1 (it READs both prefill ranks' leases and joins their heads).

Every prompt's blocks arrive by handoff (the decode computes none of them). The full
matrix (1 -> 2, 2 -> 1, PP 2 -> 1, PP 1 -> 2 over fs and p2p) runs service to service in
``test_tp_pd.py`` and ``test_pp_pd.py``, nixl's in ``test_nixl_grids.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.arch_fixtures import make_tiny_arch
from tests.e2e.router_support import metric, openai_client
from tests.service_fixtures import ProcessStack, ServiceProcess

pytestmark = pytest.mark.timeout(900)
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a far"]


def _offline_texts(model: Path, prompts: list[str], n: int) -> list[str]:
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with LLM(str(model), num_kv_blocks=64) as llm:
        return [llm.generate(p, params)[0].text for p in prompts]


def _router_texts(router: ServiceProcess, model: Path, prompts: list[str], n: int) -> list[str]:
    client = openai_client(router.url)
    out = []
    for prompt in prompts:
        done = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=n, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        out.append(done.choices[0].text)
    return out


def _stack(
    tmp: Path, model: Path, connector: tuple[str, ...], prefill: tuple[str, ...],
    decode: tuple[str, ...],
) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:  # fmt: skip
    stack = ProcessStack(tmp / "logs", model)
    try:
        p, d = stack.together(
            lambda: stack.service("prefill", connector_args=connector, extra_args=prefill),
            lambda: stack.service("decode", connector_args=connector, extra_args=decode),
        )
        router = stack.router(prefill=[p], decode=[d], extra_args=("--served-model-name", "tiny"))
        yield router, d
    finally:
        stack.close()


def _check(model: Path, router: ServiceProcess, decode: ServiceProcess) -> None:
    n = 8
    texts = _router_texts(router, model, PROMPTS, n)
    assert texts == _offline_texts(model, PROMPTS, n)
    # Every prompt block came by handoff: none recomputed on the decode.
    assert metric(decode.metrics_url, "pdserve_kv_blocks_loaded_total") > 0
    assert metric(decode.metrics_url, "pdserve_kv_blocks_recomputed_total") == 0


def test_moe_tp1_prefill_to_tp2_decode_over_p2p(tmp_path: Path) -> None:
    model = make_tiny_arch("qwen3_moe", tmp_path / "moe")
    connector = ("--connector", "p2p", "--p2p-timeout", "20")
    for router, decode in _stack(tmp_path, model, connector, (), ("--tensor-parallel-size", "2")):
        _check(model, router, decode)


def test_moe_tp2_prefill_to_tp1_decode_over_nixl(tmp_path: Path) -> None:
    model = make_tiny_arch("qwen3_moe", tmp_path / "moe")
    connector = ("--connector", "nixl", "--p2p-timeout", "20")
    for router, decode in _stack(tmp_path, model, connector, ("--tensor-parallel-size", "2"), ()):
        _check(model, router, decode)


def test_smollm2_pp2_prefill_to_pp1_decode_over_fs(tmp_path: Path, smollm2_dir: Path) -> None:
    connector = ("--connector", "fs", "--kv-path", str(tmp_path / "kv"))
    pp2 = ("--pipeline-parallel-size", "2")
    for router, decode in _stack(tmp_path, smollm2_dir, connector, pp2, ()):
        _check(smollm2_dir, router, decode)
