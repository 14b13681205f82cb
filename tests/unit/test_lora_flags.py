"""The LoRA settings (``EngineArgs``, ``RouterArgs``): ``--lora-modules`` in vLLM's form
(and its env twin), bad entries refused with the flag's name, the ``EngineConfig`` they
become, and `pdserve up` passing them on."""

from __future__ import annotations

import argparse

import pytest

from engine.args import EngineArgs, parse_lora_modules


def _args(argv: list[str]) -> EngineArgs:
    p = argparse.ArgumentParser()
    EngineArgs.add_arguments(p)
    return EngineArgs.from_args(p.parse_args(argv))


def _lora_kwargs(args: EngineArgs) -> dict[str, object]:
    mods = parse_lora_modules(args.lora_modules or ())
    return {
        "enable_lora": args.enable_lora or bool(mods),
        "lora_modules": mods,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
    }


def test_modules_flag() -> None:
    args = _args(["--lora-modules", "sql=/a/sql", "chat=rel/chat", "--max-loras", "4"])
    assert _lora_kwargs(args) == {
        "enable_lora": True,
        "lora_modules": (("sql", "/a/sql"), ("chat", "rel/chat")),
        "max_loras": 4,
        "max_lora_rank": None,  # the engine's default
    }
    off = _args([])
    assert not off.enable_lora and not off.lora_modules


def test_env_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_LORA_MODULES", "a=/x, b=/y")
    monkeypatch.setenv("PDSERVE_MAX_CPU_LORAS", "6")
    args = _args([])
    assert parse_lora_modules(args.lora_modules) == (("a", "/x"), ("b", "/y"))
    assert args.max_cpu_loras == 6


@pytest.mark.parametrize("bad", ["sql", "=/x", "sql=", "a=/x a=/y"])
def test_bad_modules_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="NAME=PATH|unique"):
        parse_lora_modules([bad])


def test_bad_flag_exits_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _args(["--lora-modules", "nopath"])
    assert "--lora-modules" in capsys.readouterr().err


def test_up_forwards_the_engine_and_router_lora_flags() -> None:
    from common.settings import forwarded_words
    from router.args import RouterArgs

    engine = {s.flag for s in EngineArgs.forwarded()}
    assert {"--lora-modules", "--max-loras", "--max-lora-rank"} <= engine
    assert "--allow-runtime-lora-updating" in {s.flag for s in RouterArgs.forwarded()}
    p = argparse.ArgumentParser()
    for s in EngineArgs.forwarded():
        s.add_to(p)
    words = forwarded_words(EngineArgs.forwarded(), p.parse_args(["--lora-modules", "x=rel/x"]))
    assert words[words.index("--lora-modules") + 1] == "x=rel/x"
