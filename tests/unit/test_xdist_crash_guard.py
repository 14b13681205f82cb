"""tests/xdist_crash_guard.py: a worker killed mid-file fails that one test, and the run ends.

Real pytest-xdist runs (two workers, ``--dist loadfile``, as ``make test``) over a few small
files, one of which kills its worker; without the guard this run never ends (xdist#1378).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FILES = {
    "test_kill.py": "import os\ndef test_first(): pass\ndef test_crash(): os._exit(1)\n"
    "def test_after(): pass\n",
    "test_lone.py": "import os, signal\ndef test_lone(): os.kill(os.getpid(), signal.SIGKILL)\n",
    **{
        f"test_ok{i}.py": "import time\ndef test_a(): time.sleep(0.1)\ndef test_b(): pass\n"
        for i in range(5)
    },
}


# No crash, one file much longer than the rest: one worker finishes and leaves while the
# other still runs (the guard once broke this ordinary end of a run: "no active workers").
CLEAN = {
    "test_long.py": "import time\ndef test_long(): time.sleep(3)\ndef test_b(): pass\n",
    **{f"test_short{i}.py": "def test_a(): pass\ndef test_b(): pass\n" for i in range(3)},
}


def run_pytest(tmp_path: Path, files: dict[str, str]) -> subprocess.CompletedProcess[str]:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.xdist_crash_guard",
         "-n", "2", "--dist", "loadfile", "-o", "addopts=", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_a_clean_run_ends_with_its_workers(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path, CLEAN)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "8 passed" in out and "INTERNALERROR" not in out, out


def test_crashed_workers_fail_their_test_and_the_run_ends(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path, FILES)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "2 failed, 12 passed" in out, out
    assert "FAILED test_kill.py::test_crash" in out and "FAILED test_lone.py::test_lone" in out, out
