"""The committed gRPC stubs in pdserve_api/v1/ match what protoc generates from proto/ now."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STUBS = "pdserve_api/v1"
GENERATED = ("pdserve_pb2.py", "pdserve_pb2_grpc.py", "pdserve_pb2.pyi")


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    shutil.copytree(REPO / "proto", tmp_path / "proto")
    protos = sorted(
        str(p.relative_to(tmp_path)) for p in (tmp_path / "proto/pdserve/v1").glob("*.proto")
    )
    assert protos, "no .proto files under proto/pdserve/v1"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Ipdserve_api=proto/pdserve",  # as `make stubs` runs it
            "--python_out=.",
            "--grpc_python_out=.",
            "--pyi_out=.",
            *protos,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"protoc failed:\n{result.stderr}"
    stale = [
        name
        for name in GENERATED
        if (tmp_path / STUBS / name).read_text() != (REPO / STUBS / name).read_text()
    ]
    assert not stale, (
        f"{STUBS}/{', '.join(stale)} are stale: run `make stubs` and commit the result"
    )
