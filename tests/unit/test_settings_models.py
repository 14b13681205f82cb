"""The settings models are the command lines (docs/design.md §3 "Settings").

Every flag of `pdserve prefill|decode|router|up` is a setting of a model and nothing else;
each flag and its env twin read the same; the engine settings name ``EngineConfig`` fields
and share their defaults; `pdserve up` forwards every ``forward=True`` engine setting to
every engine, where the service reads it back; up's own copies of child flags accept
nothing the child refuses; the tune and bench tools' engine flags are the models'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import pytest

from common.settings import ArgsModel, Setting, setting
from engine.args import SERVICE_ONLY, EngineArgs
from engine.config import EngineConfig
from kv_store.args import KVStoreSettings
from pdserve import components, launcher, tune
from pdserve.bench import offline
from pdserve.procs import Launcher
from pdserve.tune_grid import GridPoint
from pdserve.up_args import UpArgs
from router.args import RouterArgs
from service.settings import ServiceSettings, forward_engine_flags

# Texts tried in order for a value other than the default that a flag accepts.
_CANDIDATES = ("2", "3", "0.25", "64Mi", "priority", "x-probe", "ngram:k=2", "a=/x", "on", "off")
# The models behind each command line (decode's has kv-load-failure, prefill's not).
COMMANDS: dict[str, tuple[type[ArgsModel], ...]] = {
    "prefill": (ServiceSettings, EngineArgs, KVStoreSettings),
    "decode": (ServiceSettings, EngineArgs, KVStoreSettings),
    "router": (RouterArgs,),
}


@pytest.fixture(autouse=True)
def _no_env_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("PDSERVE_")]:
        monkeypatch.delenv(name)


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="pdserve")
    sub = parser.add_subparsers(dest="command", required=True)
    components.add_parser(sub)
    launcher.add_parser(sub)
    tune.add_parser(sub)
    bench = sub.add_parser("bench").add_subparsers(dest="bench")
    offline.add_offline_parsers(bench)
    return {**sub.choices, **{f"bench {k}": v for k, v in bench.choices.items()}}


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}


def example(s: Setting) -> str:
    """A flag text other than the default that ``s`` accepts."""
    if s.switch:
        return "true"
    for text in _CANDIDATES:
        try:
            value = s.from_text(text)
        except ValueError:
            continue
        if value != s.default and (s.choices is None or value in s.choices):
            return text
    assert s.choices, f"no example for {s.flag}"
    return str(next(c for c in s.choices if c != s.default))


@pytest.mark.parametrize("command", ["prefill", "decode", "router", "up"])
def test_each_command_line_is_its_models_and_nothing_else(command: str) -> None:
    if command == "up":
        declared = {f for s in UpArgs.all_settings() for f in (s.flag, *s.aliases)}
    else:
        declared = {
            f
            for model in COMMANDS[command]
            for s in model.settings()
            if not s.roles or command in s.roles
            for f in (s.flag, *s.aliases)  # vLLM's short spellings (-pp)
        }
    assert flags(subparsers()[command]) == declared
    assert ("--kv-load-failure" in declared) == (command == "decode")


@pytest.mark.parametrize("command", ["prefill", "decode", "router", "up"])
def test_a_flag_and_its_env_twin_read_the_same(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = UpArgs.all_settings() if command == "up" else [
        s for model in COMMANDS[command] for s in model.settings()
        if not s.roles or command in s.roles
    ]  # fmt: skip
    argv: list[str] = []
    for s in settings:
        argv += [s.flag] if s.switch else [s.flag, example(s)]
    by_flag = vars(subparsers()[command].parse_args(argv))
    for s in settings:
        monkeypatch.setenv(s.env, example(s))
    by_env = vars(subparsers()[command].parse_args([]))
    assert by_flag == by_env
    for s in settings:
        assert by_flag[s.dest] == s.from_text(example(s)), s.flag
        assert by_flag[s.dest] != s.default, f"{s.flag}: the example is the default"


def test_engine_settings_are_engine_config_fields_with_its_defaults() -> None:
    config = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for s in EngineArgs.settings():
        if s.name in SERVICE_ONLY:
            continue
        assert s.name in config, f"{s.flag} names no EngineConfig field: it would never arrive"
        if s.default is not None:  # None: the engine's own default
            assert s.default == config[s.name].default, s.flag


def test_every_engine_choice_makes_an_engine_config(tmp_path: Path) -> None:
    """The engine validates once more at startup: no choice the flags offer fails there
    (EngineConfig reads config.json and looks for weight files; it loads nothing)."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "model.safetensors").touch()
    for s in EngineArgs.settings():
        for choice in s.choices or ():
            args = EngineArgs(model=str(tmp_path), **{s.name: choice})
            made = args.create_engine_config()
            assert getattr(made, s.name) == choice, s.flag
    unset = EngineArgs(model=str(tmp_path)).create_engine_config()
    assert (unset.attention_backend, unset.kv_cache_memory) == ("auto", 1 << 30)
    assert unset.enable_prefix_caching and unset.speculative is None


def test_up_forwards_each_forwarded_engine_setting_to_every_engine(tmp_path: Path) -> None:
    forwarded = EngineArgs.forwarded()
    assert {s.name for s in forwarded} >= {"dtype", "max_num_seqs", "scheduling_policy"}
    argv = ["up", "--decode", "2"]
    for s in forwarded:
        argv += [s.flag] if s.switch else [s.flag, example(s)]  # a switch takes no value
    up = subparsers()["up"].parse_args(argv[1:])
    launcher._check_counts(up)
    _, parts, _ = launcher.build_plan(Launcher(up, tmp_path, tmp_path / "logs"), str(tmp_path))
    engines = [c for c in parts if c.name != "router"]
    assert [c.name for c in engines] == ["prefill-0", "decode-0", "decode-1"]
    for child in engines:
        role = child.name.split("-")[0]
        words = child.argv[child.argv.index(role) :]
        service = subparsers()[role].parse_args(words[1:])
        for s in forwarded:
            assert getattr(service, s.dest) == s.from_text(example(s)), (child.name, s.flag)
    # Unset: nothing travels, so the engine's defaults hold.
    assert forward_engine_flags(subparsers()["up"].parse_args([])) == []


_PROBES = ("", "0", "1", "2", "0.5", "-1", "65536", "auto", "none", "fs", "p2p", "cuda", "x")


def test_ups_copies_of_child_flags_accept_nothing_a_child_refuses() -> None:
    children = [*EngineArgs.settings(), *ServiceSettings.settings()]
    children += [*KVStoreSettings.settings(), *RouterArgs.settings()]
    shared = 0
    for mine in UpArgs.settings():
        for theirs in (c for c in children if c.flag == mine.flag):
            shared += 1
            if mine.choices is not None:
                assert theirs.choices is not None and set(mine.choices) <= set(theirs.choices)
            for text in _PROBES:
                try:
                    value = mine.from_text(text)
                except ValueError:
                    continue
                if mine.choices is not None and value not in mine.choices:
                    continue
                if value is None or (value == "" and theirs.type is not str):
                    continue  # unset in up: not passed on
                try:
                    theirs.from_text(str(value))
                except ValueError as exc:
                    pytest.fail(f"up {mine.flag} {text!r} passes {value!r}, a child refuses: {exc}")
    assert shared >= 15


def test_tune_grid_flags_are_pdserve_up_flags() -> None:
    parsers = subparsers()
    actions = {a.dest: a for a in parsers["tune"]._actions}
    for dest in ("connector", "device"):
        assert set(actions[dest].choices or ()) <= set(UpArgs.setting(dest).choices or ())
    point = GridPoint("disaggregated", 1, 2, max_num_seqs=8, max_num_batched_tokens=512)
    up = parsers["up"].parse_args(point.up_args())
    assert (up.prefill, up.decode, up.max_num_seqs, up.max_num_batched_tokens) == (1, 2, 8, 512)
    assert forward_engine_flags(up) == ["--max-num-seqs", "8", "--max-num-batched-tokens", "512"]


@pytest.mark.parametrize("command", ["bench throughput", "bench latency"])
def test_bench_engine_flags_are_the_engines_without_env_twins(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = subparsers()[command]
    actions = {a.dest: a for a in parser._actions}
    for name in offline.ENGINE_SETTINGS:
        s = EngineArgs.setting(name)
        action = actions[s.dest]
        assert (action.option_strings, action.default) == ([s.flag], s.default), name
        if not s.switch:
            assert action.type is s.type and action.choices == (
                list(s.choices) if s.choices else None
            )
    monkeypatch.setenv("PDSERVE_MAX_NUM_SEQS", "3")
    args = parser.parse_args(["--kv-cache-memory", "64Mi"])
    assert (args.max_num_seqs, args.kv_cache_memory) == (256, 64 << 20)


@dataclasses.dataclass
class _Listed(ArgsModel):
    names: tuple[str, ...] = setting((), many=True, help="names")
    switch: bool = setting(switch=True, help="a switch")


def test_list_and_switch_settings_from_flags_env_and_back_to_words() -> None:
    def parse(argv: list[str], env: dict[str, str]) -> _Listed:
        parser = argparse.ArgumentParser()
        _Listed.add_arguments(parser, environ=env)
        return _Listed.from_args(parser.parse_args(argv))

    assert parse([], {}) == _Listed([], False)  # type: ignore[arg-type]
    assert parse(["--names", "a", "b", "--switch"], {}) == _Listed(["a", "b"], True)  # type: ignore[arg-type]
    assert parse([], {"PDSERVE_NAMES": "c", "PDSERVE_SWITCH": "yes"}) == _Listed(["c"], True)  # type: ignore[arg-type]
    assert _Listed.from_env({"PDSERVE_NAMES": "c"}) == _Listed(["c"], False)  # type: ignore[arg-type]
    names, switch = _Listed.settings()
    assert names.words(["a", "b"]) + switch.words(True) == ["--names", "a", "b", "--switch"]
    assert names.words([]) == switch.words(False) == []
