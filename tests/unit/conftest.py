"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.unit.router_app_support import build_app


@pytest.fixture
def client(tiny_model_dir: Path) -> Iterator[TestClient]:
    """The router app with empty pools (tests/unit/router_app_support.py), small limits."""
    with TestClient(build_app(tiny_model_dir, max_prompt_tokens=64, max_body_bytes=4096)) as c:
        yield c
