"""Fixtures shared by the router end-to-end test files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.router_support import Stack
from tests.service_fixtures import ProcessStack


# Module scope: each file that uses it gets its own processes (a package-scoped stack
# would idle through the fault tests' own stacks on the 2-core CI machine).
@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("router_e2e")
    kv = root / "kv"
    kv.mkdir()
    procs = ProcessStack(root / "logs", tiny_model_dir)
    conn = ("--connector", "fs", "--kv-path", str(kv))
    try:
        prefill, decode = procs.together(
            lambda: procs.service("prefill", connector_args=conn),
            lambda: procs.service("decode", connector_args=conn),
        )
        common = [
            "--health-interval",
            "0.5",
            "--served-model-name",
            "tiny",
            "--max-prompt-tokens",
            "256",
        ]
        disagg, colocated, auto = procs.together(
            lambda: procs.router(prefill=[prefill], decode=[decode], extra_args=common),
            lambda: procs.router(decode=[decode], mode="colocated", extra_args=common),
            lambda: procs.router(
                prefill=[prefill], decode=[decode], mode="auto", extra_args=common
            ),
        )
        yield Stack(prefill, decode, disagg, colocated, auto, tiny_model_dir)
    finally:
        procs.close()
