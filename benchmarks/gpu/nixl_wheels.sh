#!/usr/bin/env bash
# Prepare, on a machine with PyPI, the NIXL the GPU image lacks (no network there) for
# tests/gpu/test_nixl_gpu.py and benchmarks/gpu/nixl_handoff_gpu.sh:
#   $CARRY/nixl.zip   nixl-cu13==1.5.1 for the image's Python (3.12, x86-64): the wheel's
#                     nixl_cu13 package and its bundled libraries (UCX included), without
#                     nixl_ep_cu13 (expert-parallel kernels, ~95 MB unpacked, unused here)
#                     and UCX's perftest plugins, so that it fits the 64 MiB a device call
#                     carries. The GPU side unzips it and puts it on PYTHONPATH.
# CARRY defaults to out/nixl_carry (git-ignored through /out/); name it in the device call's
# `carry`. Never `pip install` the wheel with its dependencies: it declares torch.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
CARRY=${CARRY:-$REPO/out/nixl_carry}
PY=${PY:-$REPO/.venv/bin/python}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
VERSION=${NIXL_VERSION:-1.5.1}

rm -rf "$CARRY"
mkdir -p "$CARRY/dl" "$CARRY/tree"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
  --implementation cp --platform manylinux_2_28_x86_64 -d "$CARRY/dl" "nixl-cu13==$VERSION"
wheel=$(find "$CARRY/dl" -name 'nixl_cu13-*.whl' | head -1)
(cd "$CARRY/tree" && unzip -q "$wheel")
rm -rf "$CARRY/tree/nixl_ep_cu13" "$CARRY/tree/nixl_cu13.scripts"
find "$CARRY/tree" -name 'libucx_perftest*' -delete
(cd "$CARRY/tree" && zip -q -r -9 "$CARRY/nixl.zip" .)
rm -rf "$CARRY/dl" "$CARRY/tree"
du -sh "$CARRY/nixl.zip"
echo "ready: carry $(realpath --relative-to="$REPO" "$CARRY") in the device call; there:"
echo "  mkdir -p /tmp/nixl && unzip -q -o $(realpath --relative-to="$REPO" "$CARRY")/nixl.zip -d /tmp/nixl"
echo "  export PYTHONPATH=\$PWD:/tmp/nixl"
