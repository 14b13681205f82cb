"""``pdserve --version`` names the installed package's version, as the router's
``GET /version`` does (tests/unit/test_router_api.py)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys


def test_version_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"pdserve {importlib.metadata.version('pdserve')}"
