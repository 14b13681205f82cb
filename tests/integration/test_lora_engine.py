"""Multi-LoRA in the engine, offline: each adapter's greedy output equals transformers +
PEFT's merged model in float32, mixed batches, slot limits with LRU swapping and the wait
deadline, KV kept apart per adapter, and bad adapters refused with a clear error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.block_hash import ROOT_PARENT, compute_block_hashes
from engine import LLM, LoRARequest, SamplingParams
from tests.lora_fixtures import make_adapter, peft_greedy
from tests.model_fixtures import make_tiny_llama

MAX_TOKENS = 8
# Long enough to fill prefix-cache blocks (block size 16), so a cache mixing adapters
# would show; the short one checks a partial block.
PROMPTS = [
    [1, *range(300, 340, 1)],
    [1, *range(100, 120), 7, 7, 7],
    [1, 42, 43, 44],
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_llama(root / "base")
    return {
        "base": base,
        "all": make_adapter(base, root / "all", seed=1, r=8),
        # a subset of modules, another rank, rsLoRA's scaling
        "qv_down": make_adapter(
            base, root / "qv_down", 2, r=4, targets=["q_proj", "v_proj", "down_proj"],
            use_rslora=True,
        ),
        "mlp": make_adapter(base, root / "mlp", 3, r=8, targets=["gate_proj", "up_proj"]),
    }  # fmt: skip


@pytest.fixture(scope="module")
def reference(lora_dirs: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    """transformers + PEFT (merged) greedy tokens per adapter (None: the base model)."""
    out: dict[str | None, list[list[int]]] = {
        None: peft_greedy(lora_dirs["base"], None, PROMPTS, MAX_TOKENS)
    }
    for name in ("all", "qv_down", "mlp"):
        out[name] = peft_greedy(lora_dirs["base"], lora_dirs[name], PROMPTS, MAX_TOKENS)
    return out


@pytest.fixture(scope="module")
def llm(lora_dirs: dict[str, Path]) -> Any:
    engine = LLM(
        str(lora_dirs["base"]),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        lora_modules=(("all", str(lora_dirs["all"])),),
    )
    yield engine
    engine.shutdown()


def _lr(dirs: dict[str, Path], name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, 1, str(dirs[name]))


def test_each_adapter_matches_peft_merged(
    llm: Any, lora_dirs: dict[str, Path], reference: Any
) -> None:
    assert len({tuple(map(tuple, v)) for v in reference.values()}) == 4  # adapters matter
    for name in (None, "all", "qv_down", "mlp"):
        got = [
            o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=_lr(lora_dirs, name))
        ]
        assert got == reference[name], name


def test_mixed_batch_three_adapters_and_base(
    llm: Any, lora_dirs: dict[str, Path], reference: Any
) -> None:
    """One generate call, every prompt under every adapter and the base, in one batch:
    three adapters over two slots, so some wait for a slot and one is swapped in."""
    names = [None, "all", "qv_down", "mlp"]
    prompts = [p for _ in names for p in PROMPTS]
    loras = [_lr(lora_dirs, n) for n in names for _ in PROMPTS]
    loads = llm.engine.lora.manager.stats.loads
    got = [o.token_ids for o in llm.generate(prompts, GREEDY, lora_request=loras)]
    want = [t for n in names for t in reference[n]]
    assert got == want
    assert llm.engine.lora.manager.stats.loads > loads
    assert len(llm.engine.lora.manager.resident) <= 2


def test_block_hashes_are_rooted_at_the_adapter(llm: Any) -> None:
    """The same tokens under two adapters (or the base) share no block hash."""
    mgr = llm.engine.lora.manager
    roots = {mgr.hash_root(None), mgr.hash_root("all"), mgr.hash_root("qv_down")}
    assert len(roots) == 3 and ROOT_PARENT in roots
    chains = [set(compute_block_hashes(PROMPTS[0], 16, root=r)) for r in roots]
    assert not (chains[0] & chains[1] or chains[0] & chains[2] or chains[1] & chains[2])


def _cached_tokens(llm: Any, rid: str, prompt: list[int], lora: str | None) -> int:
    """Run one request on the engine; the prompt tokens its prefix cache served."""
    engine = llm.engine
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0), lora_name=lora)
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                cached = out.num_cached_tokens
    return cached


def test_prefix_cache_hits_stay_within_an_adapter(llm: Any) -> None:
    """A prompt cached under one adapter is a hit for that adapter only."""
    llm.engine.reset_prefix_cache()
    prompt = PROMPTS[0]
    assert _cached_tokens(llm, "pc-1", prompt, "all") == 0
    assert _cached_tokens(llm, "pc-2", prompt, "all") == 32  # two full blocks
    assert _cached_tokens(llm, "pc-3", prompt, "mlp") == 0
    assert _cached_tokens(llm, "pc-4", prompt, None) == 0
    assert _cached_tokens(llm, "pc-5", prompt, None) == 32


def test_unknown_adapter_and_lora_off_are_refused(llm: Any, lora_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="not loaded and has no path"):
        llm.generate([PROMPTS[2]], GREEDY, lora_request=LoRARequest("nope"))
    with pytest.raises(ValueError, match="is loaded from"):
        llm.generate(
            [PROMPTS[2]], GREEDY, lora_request=LoRARequest("all", 1, str(lora_dirs["mlp"]))
        )
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        llm.engine.add_request("unknown", PROMPTS[2], GREEDY, lora_name="nope")
    with pytest.raises(ValueError, match="got 1 LoRA requests for 2 prompts"):
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[None])
