"""Shared helpers for the Helm chart tests: render the chart with the real ``helm``
binary, pick objects out of the result, and run the real ``kubernetes-validate`` schemas
(Kubernetes 1.35, strict: unknown fields fail)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "pdserve"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
KUBE_VERSION = "1.35.0"
RELEASE = "rel"
NS = "serving"


def helm_binary() -> str:
    local = REPO / ".tools" / "bin" / "helm"
    if local.exists():
        return str(local)
    found = shutil.which("helm")
    if found is None:
        pytest.fail("the helm binary is missing: run `make tools` (installs .tools/bin/helm)")
    return found


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def render_text(*values: Path, sets: tuple[str, ...] = ()) -> str:
    args = ["template", RELEASE, str(CHART), "--namespace", NS, "--kube-version", KUBE_VERSION]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    return helm(*args).stdout


def render(*values: Path, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render_text(*values, sets=sets)) if d]


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in objs:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(
        f"{kind}/{name} not rendered; have {[(o['kind'], o['metadata']['name']) for o in objs]}"
    )


def workload(objs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    """A component's Deployment, or with pipeline parallelism its first group's StatefulSet
    (every group's pod template is the same but for its group label and leader)."""
    name = f"{RELEASE}-pdserve-{component}"
    for obj in objs:
        if (obj["kind"], obj["metadata"]["name"]) in {
            ("Deployment", name),
            ("StatefulSet", f"{name}-0"),
        }:
            return obj
    return find(objs, "Deployment", name)


def kinds(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def container(workload: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def ci(name: str) -> Path:
    return CHART / "ci" / f"{name}-values.yaml"


def pod_templates(objs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for o in objs:
        if o["kind"] in {"Deployment", "StatefulSet", "Job"}:
            yield o["spec"]["template"]


def kubernetes_validate(text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "rendered.yaml"
    path.write_text(text)
    tool = [sys.executable, "-m", "kubernetes_validate"]
    if shutil.which("kubernetes-validate"):
        tool = [str(shutil.which("kubernetes-validate"))]
    return subprocess.run(
        [*tool, "--strict", "-k", KUBE_VERSION, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
