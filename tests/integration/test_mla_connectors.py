"""A DeepSeek-V3 (MLA latent cache) prefill handed over through the stores that
tests/integration/test_arch_pd.py does not cover (it runs fs and p2p): Redis and LMCache,
real servers, producer and consumer in processes of their own. The consumer loads every
latent block (none recomputed) and its greedy tokens equal a colocated engine's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.arch_fixtures import make_tiny_arch
from tests.integration.test_engine_kv import PROMPT, _colocated, _settings, _worker

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_arch("deepseek_v3", tmp_path_factory.mktemp("mla_v3"))


@pytest.mark.parametrize("backend", ["redis", "lmcache"])
def test_latent_handoff_matches_colocated(
    v3_dir: Path, tmp_path: Path, request: pytest.FixtureRequest, backend: str
) -> None:
    settings = json.dumps(_settings(backend, tmp_path, request))
    # Prompts of their own per run: the LMCache server outlives a test.
    prompt = [t + 7 + len(str(tmp_path)) for t in PROMPT]
    produced = _worker("produce", str(v3_dir), settings, json.dumps(prompt))
    assert len(produced["keys"]) == 3
    consumed = _worker("consume", str(v3_dir), settings, json.dumps(prompt), str(produced["first"]))
    assert consumed["loaded"] == 3 and consumed["recomputed"] == 0
    assert consumed["tokens"] == _colocated(v3_dir, prompt)
