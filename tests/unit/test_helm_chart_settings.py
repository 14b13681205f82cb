"""The Helm chart agrees with the settings models (docs/design.md §3 "Settings").

A setting declared with ``helm=PATH`` (``engine/args.py``, ``service/settings.py``,
``kv_store/args.py``, ``router/args.py``) says that chart value sets its env twin. For each:

- ``values.schema.json`` admits only values the setting's flag accepts (every probe value
  the schema lets through parses, and lands in the flag's choices);
- rendered (real ``helm template``, from a values file as a user writes one) with a value
  other than the default, the value reaches the pods as the flag's ``PDSERVE_*`` twin, and
  the component's real command line (``pdserve prefill|decode|router``) reads it back.

And in the other direction: every ``PDSERVE_*`` variable the chart gives a pod is a flag of
the process in it, and every ``engine.*`` value is a setting or named pod-level here.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from common.settings import ArgsModel, Setting
from engine.args import EngineArgs
from kv_store.args import KVStoreSettings
from pdserve import components
from router.args import RouterArgs
from service.settings import ServiceSettings
from tests.unit.helm_support import CHART, CI_VALUES, RELEASE, container, find, render, workload

ENGINE_PODS = ("prefill", "decode")
MODELS: dict[type[ArgsModel], tuple[str, ...]] = {
    EngineArgs: ENGINE_PODS,
    ServiceSettings: ENGINE_PODS,
    KVStoreSettings: ENGINE_PODS,
    RouterArgs: ("router",),
}
SCHEMA = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
VALUES = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
# Chart values under engine.* that shape the pod, not a flag.
POD_LEVEL = {"engine.shmSizeLimit", "engine.pipelinePort", "engine.pipelinePodPerStage"}
# Variables the chart sets that are read outside argparse (pdserve/cli.py's log level).
NOT_FLAGS = {"PDSERVE_LOG_LEVEL"}


def mapped() -> Iterator[tuple[Setting, str, tuple[str, ...]]]:
    """(setting, chart value path, the pods whose process reads it)."""
    for model, pods in MODELS.items():
        for s in model.settings():
            for path in s.helm:
                head = path.split(".")[0]
                which = (head,) if head in ENGINE_PODS else pods
                yield s, path, tuple(p for p in which if not s.roles or p in s.roles)


MAPPED = list(mapped())
IDS = [path for _, path, _ in MAPPED]


def node_at(path: str) -> dict[str, Any]:
    node = SCHEMA
    for part in path.split("."):
        assert "properties" in node and part in node["properties"], f"no schema for {path}"
        node = node["properties"][part]
    return node


def default_at(path: str) -> Any:
    value = VALUES
    for part in path.split("."):
        value = value[part]
    return value


def as_env(value: Any) -> str:
    """A chart value as its env twin's text (what the templates write)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


_NUMBERS = (-1, 0, 1e-9, 0.5, 0.9, 1, 1.5, 2, 63, 64, 65, 30.5, 65535, 65536, 2**20, 1e7)
_STRINGS = (
    *("0", "auto", "lots", "-1", "10Gi", "1.5G", "512Mi", "10GiB", "1e9", "/kv", "kv"),
    *("redis://h:6379/0", "rediss://h:1", "http://h:1", "lm://h:1", "a,b", " x "),
)
_ARRAYS = ([], ["a"], ["a", "b"], ["a,b"], [""], ["a b"])


def probes(path: str, node: dict[str, Any]) -> list[Any]:
    return [
        *node.get("enum", ()),
        default_at(path),
        *_NUMBERS,
        *_STRINGS,
        *_ARRAYS,
        True,
        False,
    ]


def test_every_mapped_setting_is_in_the_schema_and_values() -> None:
    assert len(MAPPED) >= 20  # engine, service, KV and router settings all map
    for _, path, pods in MAPPED:
        node_at(path)
        default_at(path)
        assert pods, path


@pytest.mark.parametrize(("setting", "path", "pods"), MAPPED, ids=IDS)
def test_schema_admits_only_what_the_flag_accepts(
    setting: Setting, path: str, pods: tuple[str, ...]
) -> None:
    node = node_at(path)
    validator = jsonschema.Draft7Validator(node)
    admitted = [p for p in probes(path, node) if validator.is_valid(p)]
    assert default_at(path) in admitted or default_at(path) is None
    checked = 0
    for value in admitted:
        # "" and null are the chart's "unset": it leaves the env twin out or fills its own.
        if value is None or value == "":
            continue
        try:
            parsed = setting.from_text(as_env(value))
        except ValueError as exc:
            pytest.fail(f"{path}: the schema admits {value!r}, {setting.flag} refuses it: {exc}")
        if setting.choices is not None:
            assert parsed in setting.choices, f"{path}: {value!r} not a {setting.flag} choice"
        checked += 1
    assert checked, f"{path}: no probe value passes the schema"


def example(path: str, node: dict[str, Any]) -> Any:
    """A value other than the default that the schema admits, rendered to exercise the
    template (big numbers: Helm reads a values file's numbers as floats)."""
    default = default_at(path)
    types = node["type"] if isinstance(node["type"], list) else [node["type"]]
    if "enum" in node:
        return next(v for v in node["enum"] if v != default)
    if "boolean" in types:
        return not default
    if "integer" in types:
        return node.get("maximum", 2**21)
    if "number" in types:
        return node.get("maximum", 2.5e6)
    if "array" in types:
        return ["probe-a.example", "probe-b.example"]
    strings = {
        "connector.fs.mountPath": "/probe-kv",
        "connector.redis.url": "redis://probe:6390/1",
        "connector.lmcache.url": "lm://probe:65000",
        "connector.capacity": "3Gi",
        "engine.kvOffloadingSize": "2Gi",
        "kvKeyPrefix": "probe:",
        "tracing.otlpTracesEndpoint": "http://probe-collector:4317",
    }
    assert path in strings, f"add an example value for the string setting {path}"
    return strings[path]


# Values a chart value needs before the chart renders its env twin at all.
NEEDS: dict[str, dict[str, Any]] = {
    "connector.fs.": {"connector": {"type": "fs"}},
    "connector.lmcache.": {"connector": {"type": "lmcache"}},
    "connector.p2p.": {"connector": {"type": "p2p"}},
    "grpcTls.": {"grpcTls": {"enabled": True, "engineSecret": "e", "routerSecret": "r"}},
    "router.apiKey.": {"router": {"apiKey": {"existingSecret": "api"}}},
}


# Values that change which other variables the chart renders: each is rendered alone.
SCENARIO_KEYS = {"connector.type"}


def _need(path: str) -> str:
    return next((prefix for prefix in NEEDS if path.startswith(prefix)), "")


def render_groups() -> list[list[tuple[Setting, str, tuple[str, ...]]]]:
    """MAPPED in as few renders as agree: one scenario each (NEEDS), no scenario key
    beside others, and no two values of one name (engine.maxNumSeqs and its per-pool
    override set together would hide each other)."""
    groups: list[list[tuple[Setting, str, tuple[str, ...]]]] = []
    for item in MAPPED:
        path = item[1]
        leaf = path.rsplit(".", 1)[-1]
        for group in groups:
            paths = [other for _, other, _ in group]
            if (
                _need(paths[0]) == _need(path)
                and not {path, *paths} & SCENARIO_KEYS
                and all(other.rsplit(".", 1)[-1] != leaf for other in paths)
            ):
                group.append(item)
                break
        else:
            groups.append([item])
    return groups


def values_for(paths: dict[str, Any]) -> dict[str, Any]:
    """A values file setting each path (and what its scenario needs)."""
    values: dict[str, Any] = json.loads(json.dumps(NEEDS.get(_need(next(iter(paths))), {})))
    for path, value in paths.items():
        node = values
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return values


def pod_env(objs: list[dict[str, Any]], pod: str) -> tuple[dict[str, str], dict[str, str]]:
    """(the ConfigMap's variables, the container's own) of a pod; ``valueFrom`` entries
    get a stand-in (a Secret's key, the pod IP, the namespace)."""
    config = find(objs, "ConfigMap", f"{RELEASE}-pdserve")["data"]
    own = {}
    for e in container(workload(objs, pod)).get("env", []):  # a pipeline group: group 0
        # valueFrom: a stand-in (a pipeline pod's ordinal is its stage)
        ref = str(e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", ""))
        own[e["name"]] = e.get("value", "1" if "pod-index" in ref else "10.0.0.7")
    return dict(config), own


def parse(pod: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The pod's command line (`pdserve prefill|decode|router`) parsed under ``env`` alone."""
    for name in [n for n in os.environ if n.startswith("PDSERVE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser(prog="pdserve")
    components.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args([pod])


GROUPS = render_groups()


@pytest.mark.parametrize("group", GROUPS, ids=["+".join(p for _, p, _ in g) for g in GROUPS])
def test_chart_values_reach_the_pods_as_their_flags(
    group: list[tuple[Setting, str, tuple[str, ...]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    examples = {path: example(path, node_at(path)) for _, path, _ in group}
    file = tmp_path / "values.yaml"
    file.write_text(yaml.safe_dump(values_for(examples)), encoding="utf-8")
    objs = render(file)
    for setting, path, pods in group:
        value = examples[path]
        for pod in pods:
            config, own = pod_env(objs, pod)
            env = {**config, **own} if pod in ENGINE_PODS else {"PDSERVE_MODEL": "/m", **own}
            if value or not setting.switch:  # a switch that is off: the chart leaves it out
                assert setting.env in env, f"{path} did not set {setting.env} in the {pod} pod"
            args = parse(pod, env, monkeypatch)
            assert getattr(args, setting.dest) == setting.from_text(as_env(value)), (path, pod)


def flags_of(pod: str, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    for name in [n for n in os.environ if n.startswith("PDSERVE_")]:
        monkeypatch.delenv(name)
    parser = argparse.ArgumentParser(prog="pdserve")
    sub = parser.add_subparsers(dest="command", required=True)
    components.add_parser(sub)
    actions = sub.choices[pod]._actions
    return {"PDSERVE_" + o[2:].upper().replace("-", "_") for a in actions for o in a.option_strings}


@pytest.mark.parametrize("values", CI_VALUES, ids=[v.stem for v in CI_VALUES])
def test_every_variable_the_chart_sets_is_a_flag(
    values: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = render(values)
    for pod in ("prefill", "decode", "router"):
        config, own = pod_env(objs, pod)
        flags = flags_of(pod, monkeypatch) | NOT_FLAGS
        # The router reads the shared ConfigMap too, but only its own flags from it.
        names = {*config, *own} if pod in ENGINE_PODS else set(own)
        unknown = {n for n in names if n.startswith("PDSERVE_")} - flags
        assert not unknown, f"{values.name}: {pod} gets {sorted(unknown)}, not its flags"
        if pod in ENGINE_PODS:  # and the process starts with them
            parse(pod, {**config, **own}, monkeypatch)


def test_every_engine_value_is_a_setting_or_pod_level() -> None:
    claimed = {path for _, path, _ in MAPPED}
    keys = {f"engine.{k}" for k in SCHEMA["properties"]["engine"]["properties"]}
    assert keys - claimed == POD_LEVEL
