"""Where benchmarks write their results, and the command line they record.

Every benchmark runs as a module from the repository root (``python -m
benchmarks.<area>.<name>``); its default output is the committed file under
``benchmarks/results/<area>/``, so the command a report records rewrites that file.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = Path(__file__).resolve().parent / "configs"


def result_path(area: str, name: str) -> Path:
    """``benchmarks/results/<area>/<name>`` (the committed result of a benchmark)."""
    return RESULTS / area / name


def recorded_command(module: str, argv: list[str] | None = None) -> str:
    """The command line to record: ``python -m <module> <args>`` (``argv`` defaults to
    this process's arguments)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", "-m", module, *(shlex.quote(a) for a in args)])


def write_report(report: dict[str, Any], out: str | Path, device: str) -> None:
    """Name the GPU in ``report`` (a CUDA ``device``), print it and write it to ``out``
    as JSON."""
    if device.startswith("cuda"):
        import torch

        report["gpu"] = torch.cuda.get_device_name()
    text = json.dumps(report, indent=2)
    print(text)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text + "\n")
