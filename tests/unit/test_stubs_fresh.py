"""The committed gRPC stubs in pdserve/v1/ match what protoc generates from proto/ now."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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
            "-Iproto",
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
        if (tmp_path / "pdserve/v1" / name).read_text() != (REPO / "pdserve/v1" / name).read_text()
    ]
    assert not stale, (
        f"pdserve/v1/{', '.join(stale)} are stale: run `make stubs` and commit the result"
    )
