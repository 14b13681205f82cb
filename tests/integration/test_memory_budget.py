"""Memory promised at start is checked against the machine's (common/memory_budget.py;
issue #36): `pdserve up` counts every engine it would start, and refuses with the sizes
before starting any; a single service asked for ``64Ti`` of host KV tier says so instead
of ending in an allocator traceback. Real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.memory_budget import EngineMemory, check_host, host_memory_bytes
from pdserve.procs import free_ports
from tests.service_fixtures import REPO, child_env

TIMEOUT = 90.0


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", *argv],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"still running after {TIMEOUT} s (it should have refused):\n{out[-2000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def test_up_counts_every_engine(tiny_model_dir: Path) -> None:
    total = host_memory_bytes()
    assert total
    # One engine's tier fits the machine; two do not.
    tier_gib = (total // 2 >> 30) + 2
    (port,) = free_ports(1)
    argv = ["up", "--model", str(tiny_model_dir), "--mode", "colocated", "--prefill", "0"]
    argv += ["--decode", "2", "--port", str(port), "--kv-offloading-size", f"{tier_gib}Gi"]
    result = _run(argv)
    assert result.returncode == 1, result.stdout[-2000:]
    assert "2 engines would need" in result.stdout, result.stdout[-2000:]
    assert "--kv-offloading-size" in result.stdout and "Traceback" not in result.stdout


def test_a_service_refuses_64ti_clearly(tiny_model_dir: Path) -> None:
    port, metrics = free_ports(2)
    argv = ["decode", "--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--metrics-port", str(metrics), "--kv-offloading-size", "64Ti"]
    result = _run(argv)
    assert result.returncode != 0, result.stdout[-2000:]
    assert "64.0 TiB" in result.stdout and "host KV tier" in result.stdout, result.stdout[-2000:]
    assert "Traceback" not in result.stdout, result.stdout[-3000:]


def test_the_check_names_the_sizes() -> None:
    cpu = EngineMemory("cpu", kv_cache=2 << 30, host_tier=4 << 30)
    check_host([cpu], 6 << 30, "this machine")  # exactly fits
    with pytest.raises(ValueError, match=r"KV cache 4.0 GiB .* host KV tier 8.0 GiB"):
        check_host([cpu, cpu], 10 << 30, "this machine")
    gpu = EngineMemory("cuda", kv_cache=80 << 30, host_tier=3 << 30)  # GPU KV: not host memory
    with pytest.raises(ValueError, match=r"host KV tier pinned 6.0 GiB"):
        check_host([gpu, gpu], 5 << 30, "this machine")
    check_host([gpu], 3 << 30, "this machine")
