"""LoRA slots: one slot shared by two adapters (LRU swap, a waiting request passes
nobody's way and fails past its deadline), and adapters the engine refuses, each with a
message naming the problem."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.lora.manager import SLOT_TIMEOUT_ERROR
from tests.lora_fixtures import make_adapter
from tests.model_fixtures import make_tiny_llama

PROMPT = [1, *range(500, 520)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_slots")
    base = make_tiny_llama(root / "base")
    return {
        "root": root,
        "base": base,
        "a": make_adapter(base, root / "a", seed=1, r=4),
        "b": make_adapter(base, root / "b", seed=2, r=4, targets=["o_proj"]),
        "wide": make_adapter(base, root / "wide", seed=3, r=16),
    }


@pytest.fixture(scope="module")
def llm(dirs: dict[str, Path]) -> Any:
    engine = LLM(
        str(dirs["base"]),
        dtype="float32",
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,
        max_lora_rank=8,
        lora_wait_timeout=60.0,
        lora_modules=(("a", str(dirs["a"])), ("b", str(dirs["b"]))),
    )
    yield engine
    engine.shutdown()


def _drain(engine: Any) -> dict[str, Any]:
    done: dict[str, Any] = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "engine did not finish in 60 s"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_waiting_for_a_slot_ends_at_the_deadline(llm: Any) -> None:
    """With the one slot pinned by a running request for adapter a, a request for b
    waits (a base-model request passes it) and fails with the slot error past its
    deadline; a second request for a shares the slot at once."""
    engine = llm.engine
    mgr = engine.lora.manager
    mgr.wait_timeout = 0.3  # for requests added from here on
    long = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request("a1", PROMPT, long, lora_name="a")
    engine.step()
    engine.add_request("b1", PROMPT, long, lora_name="b")
    engine.add_request("base1", PROMPT, long)
    engine.add_request("a2", PROMPT, long, lora_name="a")
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert running == {"a1", "base1", "a2"}
    assert engine.lora.num_waiting_for_slot(engine.scheduler) == 1
    mgr.wait_timeout = 60.0
    time.sleep(0.4)
    done = _drain(engine)
    assert done["b1"].error == SLOT_TIMEOUT_ERROR and done["b1"].new_token_ids == []
    assert all(done[r].error is None for r in ("a1", "base1", "a2"))
    assert mgr.stats.slot_timeouts == 1
    assert mgr.resident == ["a"] and mgr.num_in_use == 0


def test_lru_swap_between_two_adapters(llm: Any) -> None:
    """One slot, the two adapters in turn: each turn evicts the other and loads again
    (from disk for the one the one-entry host cache no longer holds); outputs do not
    depend on the swaps."""
    mgr = llm.engine.lora.manager
    from engine import LoRARequest

    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = {
        n: llm.generate([PROMPT], greedy, lora_request=LoRARequest(n))[0].token_ids for n in "ab"
    }
    assert first["a"] != first["b"]
    loads, evictions = mgr.stats.loads, mgr.stats.evictions
    for n in "abab":
        assert llm.generate([PROMPT], greedy, lora_request=LoRARequest(n))[0].token_ids == first[n]
    assert mgr.stats.loads - loads == 4 and mgr.stats.evictions - evictions == 4
    # mixed in one call: both finish, through the one slot
    mixed = llm.generate([PROMPT] * 4, greedy, lora_request=[LoRARequest(n) for n in "abab"])
    assert [o.token_ids for o in mixed] == [first[n] for n in "abab"]


def _broken(dirs: dict[str, Path], name: str, edit: Any) -> str:
    out = dirs["root"] / f"broken_{name}"
    shutil.copytree(dirs["a"], out, dirs_exist_ok=True)
    edit(out)
    return str(out)


def _set_config(key: str, value: Any) -> Any:
    def edit(path: Path) -> None:
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg[key] = value
        (path / "adapter_config.json").write_text(json.dumps(cfg))

    return edit


def _edit_tensors(change: Any) -> Any:
    def edit(path: Path) -> None:
        f = path / "adapter_model.safetensors"
        save_file(change(load_file(str(f))), str(f))

    return edit


def _wrong_shape(t: dict[str, Any]) -> dict[str, Any]:
    key = next(k for k in t if "q_proj.lora_A" in k)
    t[key] = t[key][:, :32].contiguous()  # an adapter of a base with hidden 32
    return t


def _extra_layer(t: dict[str, Any]) -> dict[str, Any]:
    key = next(k for k in t if "layers.0." in k)
    t[key.replace("layers.0.", "layers.7.")] = t[key].clone()
    return t


def _embedding(t: dict[str, Any]) -> dict[str, Any]:
    t["base_model.model.model.embed_tokens.lora_A.weight"] = next(iter(t.values())).clone()
    return t


def _only_a(t: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in t.items() if "lora_B" not in k}


@pytest.mark.parametrize(
    ("case", "edit", "message"),
    [
        ("wrong_shape", _edit_tensors(_wrong_shape), r"needs \(4, 64\).*another base model"),
        ("extra_layer", _edit_tensors(_extra_layer), "layer 7 but the base model has 2 layers"),
        ("embedding", _edit_tensors(_embedding), "not a LoRA weight of an attention or MLP"),
        ("half", _edit_tensors(_only_a), "lacks lora_A or lora_B"),
        ("dora", _set_config("use_dora", True), "use_dora=true is not supported"),
        ("not_lora", _set_config("peft_type", "IA3"), "is not LORA"),
        ("no_weights", lambda p: (p / "adapter_model.safetensors").unlink(), "has no adapter_model.safetensors"),
        ("no_config", lambda p: (p / "adapter_config.json").unlink(), "has no adapter_config.json"),
        ("bad_json", lambda p: (p / "adapter_config.json").write_text("{"), "is not JSON"),
        ("truncated", lambda p: (p / "adapter_model.safetensors").write_bytes(b"\x10"), "cannot read"),
    ],
)  # fmt: skip
def test_bad_adapter_is_refused(
    llm: Any, dirs: dict[str, Path], case: str, edit: Any, message: str
) -> None:
    path = _broken(dirs, case, edit)
    with pytest.raises(ValueError, match=message):
        llm.engine.lora.add_adapter(case, path)
    assert case not in llm.engine.lora.manager.registry


def test_rank_missing_dir_and_names_are_refused(llm: Any, dirs: dict[str, Path]) -> None:
    lora = llm.engine.lora
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank 8"):
        lora.add_adapter("wide", str(dirs["wide"]))
    with pytest.raises(ValueError, match="is not a directory"):
        lora.add_adapter("gone", str(dirs["root"] / "gone"))
    with pytest.raises(ValueError, match="'a' is already loaded"):
        lora.add_adapter("a", str(dirs["b"]))
    with pytest.raises(ValueError, match="'zzz' is not loaded"):
        lora.remove_adapter("zzz")


def test_settings_are_checked(dirs: dict[str, Path]) -> None:
    base = str(dirs["base"])
    for kwargs, message in [
        ({"enable_lora": True, "max_loras": 0}, "max_loras must be >= 1"),
        ({"enable_lora": True, "max_lora_rank": 1024}, "max_lora_rank must be in"),
        ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
        ({"lora_modules": (("a", "/x"),)}, "lora_modules needs enable_lora"),
        ({"enable_lora": True, "lora_modules": (("a", "/x"), ("a", "/y"))}, "unique"),
        ({"enable_lora": True, "lora_wait_timeout": 0}, "lora_wait_timeout"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(model=base, **kwargs)
    with pytest.raises(ValueError, match="is not a directory"):
        LLM(base, enable_lora=True, lora_modules=(("x", str(dirs["root"] / "none")),))
