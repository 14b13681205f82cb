"""The Helm chart as a whole: ``helm lint --strict``, strict schema validation of every
rendered object, and clear errors for bad values. Helpers live in ``helm_support``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.helm_support import (
    CHART,
    CI_VALUES,
    KUBE_VERSION,
    RELEASE,
    ci,
    helm,
    kubernetes_validate,
    render_text,
)


def test_ci_values_cover_the_required_scenarios() -> None:
    assert {p.name for p in CI_VALUES} >= {
        "default-values.yaml",
        "redis-values.yaml",
        "lmcache-values.yaml",
        "fs-pvc-values.yaml",
        "autoscaler-values.yaml",
    }


@pytest.mark.parametrize(
    "values", [None, *CI_VALUES], ids=lambda v: "chart-defaults" if v is None else v.stem
)
def test_helm_lint_strict(values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION]
    if values is not None:
        args += ["-f", str(values)]
    proc = helm(*args, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda v: v.stem)
def test_rendered_objects_pass_strict_schema_validation(values: Path, tmp_path: Path) -> None:
    proc = kubernetes_validate(render_text(values), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ERROR" not in proc.stdout
    assert proc.stdout.count("passed for resource") >= 15


def test_schema_validation_would_catch_a_bad_field(tmp_path: Path) -> None:
    # Negative control: the validator really rejects an unknown field in our objects.
    text = render_text(ci("default")).replace(
        "terminationGracePeriodSeconds:", "terminationGracePeriodSecs:", 1
    )
    proc = kubernetes_validate(text, tmp_path)
    assert proc.returncode != 0 and "terminationGracePeriodSecs" in proc.stdout + proc.stderr


def test_bad_values_are_rejected_with_a_clear_error() -> None:
    for sets, message in [
        ("connector.type=s3", "connector/type"),
        ("router.discovery=consul", "router/discovery"),
        ("decode.kvLoadFailure=ignore", "kvLoadFailure"),
        ("prefill.typo=1", "typo"),
        (
            "autoscaler.enabled=true,autoscaler.prefill.minReplicas=9",
            "minReplicas (9) must not exceed",
        ),
    ]:
        proc = helm("template", RELEASE, str(CHART), "--set", sets, check=False)
        assert proc.returncode != 0 and message in proc.stderr, (sets, proc.stderr)
