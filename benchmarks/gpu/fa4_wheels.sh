#!/usr/bin/env bash
# Download, on a machine with PyPI, the FlashAttention-4 wheels for the GPU image (Python
# 3.12, x86-64, torch built for CUDA 13; no network there): flash-attn-4 and its needs
# that the image lacks. The image already holds torch, triton, einops, typing-extensions,
# cuda-bindings and protobuf, so those are left out.
#   WHEELS (default .wheels/fa4, git-ignored): the wheels, ~98 MB in all.
# The largest one (nvidia-cutlass-dsl-libs-cu13, ~92 MB) is over the 64 MiB that one
# device call carries, so it is also split into $WHEELS/../fa4a and $WHEELS/../fa4b
# (two carries; the second call joins the parts: `cat .wheels/fa4a/*.part.* .wheels/fa4b/*.part.* > X.whl`).
# Install there with: python3 -m pip install --no-index --no-deps WHEELS/*.whl
# (into the image's own python: the CUTLASS DSL needs its .pth files processed).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
WHEELS=${WHEELS:-$REPO/.wheels/fa4}
PY=${PY:-$REPO/.venv/bin/python}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}

PACKAGES=(
  flash-attn-4==4.0.0b36
  nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1
  quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
)
PLATFORMS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done

mkdir -p "$WHEELS"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
  --implementation cp "${PLATFORMS[@]}" -d "$WHEELS" "${PACKAGES[@]}"
count=$(find "$WHEELS" -name "*.whl" | wc -l)
if [ "$count" -ne "${#PACKAGES[@]}" ]; then
  echo "expected ${#PACKAGES[@]} wheels in $WHEELS, got $count" >&2
  exit 1
fi

big=$(ls "$WHEELS"/nvidia_cutlass_dsl_libs_cu13-*.whl)
A=$(dirname "$WHEELS")/fa4a
B=$(dirname "$WHEELS")/fa4b
rm -rf "$A" "$B"
mkdir -p "$A" "$B"
split -b 52M "$big" "$A/$(basename "$big").part."
mv "$A/$(basename "$big").part.ab" "$B/"
for w in "$WHEELS"/*.whl; do [ "$w" = "$big" ] || cp "$w" "$B/"; done
du -sh "$WHEELS" "$A" "$B"
echo "ready: carry $(realpath --relative-to="$REPO" "$A") in one device call, then" \
  "$(realpath --relative-to="$REPO" "$B") in the next"
