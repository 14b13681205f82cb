"""Run a test module's cases in a child process under Triton's interpreter.

TRITON_INTERPRET=1 must be set before triton is first imported, and another test in the
same pytest process may already have imported it, so kernel tests that run on the CPU
execute their module as a script in a fresh process and read its JSON result back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


# The interpreter's ``tl.dot`` is numpy's matmul, i.e. OpenBLAS. OpenBLAS picks its sgemm
# kernel by CPU: the Haswell/Zen kernels (AVX2 machines, AMD EPYC) round a row's result
# differently by the row's position in the tile, which a GPU's MMA does not; the SkylakeX
# and Sandybridge kernels do not. Tests of bit-exact row invariance pin the Sandybridge
# kernel (AVX only: every x86-64 CI machine has it) so they check the Triton kernel's
# reduction order, not the host's BLAS.
ROW_INVARIANT_BLAS = {"OPENBLAS_CORETYPE": "Sandybridge"}


def run_interpreted(
    script: str, timeout_s: float = 300, extra_env: dict[str, str] | None = None
) -> tuple[Any, str]:
    """Run ``script`` (a test module's path) with TRITON_INTERPRET=1; returns the JSON on
    the last line of its stdout and its stderr. A missing triton is a failure, not a skip.
    ``extra_env``: more variables for the child (e.g. ``ROW_INVARIANT_BLAS``)."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"triton is not installed ({exc}); it is a dev dependency: pip install triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.update(extra_env or {})
    proc = subprocess.run(
        [sys.executable, script], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def interpreted_results(script: str) -> dict[str, Any]:
    """``run_interpreted`` for a module whose JSON is a ``{case: result}`` object; echoes
    the first stderr line (the modules print their seed there) so a failure names it."""
    results, stderr = run_interpreted(script)
    print(stderr.strip().splitlines()[0])
    return dict(results)
