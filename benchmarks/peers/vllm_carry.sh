#!/usr/bin/env bash
# Pack vLLM 0.24.0 (and what it needs that the H200 image lacks) for a GPU machine that has no
# network and takes at most 64 MiB of files per call. Run here, on a machine with PyPI:
#
#   bash benchmarks/peers/vllm_carry.sh            # -> .carry/vllm/p1 .. pN (git-ignored)
#
# Then, on the GPU machine, one call per part, back to back so the machine stays warm:
#   call k (carry .carry/vllm/pk):  bash benchmarks/peers/vllm_install.sh stash .carry/vllm/pk
#   last call:                      bash benchmarks/peers/vllm_install.sh unpack  (then run)
# (docs/benchmarking.md, "vLLM beside pdserve", says it step by step.)
#
# What is in the pack: one site-packages tree (installed here with pip --target for CPython
# 3.12 / x86-64, no dependency resolution) holding vLLM, flashinfer-python, a flashinfer-cubin
# without its cubins, and the pins of vllm_requirements.txt. What is left out, and why:
#   - torch, triton, transformers, numpy, the CUDA wheels: the image's own are used (vLLM
#     0.24.0 pins torch==2.11.0, which is the image's);
#   - vllm_flash_attn/_vllm_fa2_C (190 MB): Hopper runs FlashAttention 3 (_vllm_fa3_C stays);
#   - vllm-rs (37 MB, a Rust front end we do not run), deep_gemm builds for other Pythons,
#     third_party/fmha_sm100 (Blackwell only);
#   - flashinfer-cubin's cubins (447 MB): trtllm-gen kernels for Blackwell (sm100); on Hopper
#     flashinfer compiles what it needs with the image's nvcc (JIT, cached in ~/.cache);
#   - tilelang, z3-solver, tokenspeed-*, humming-kernels, nvidia-cutlass-dsl, quack-kernels:
#     kernels for other architectures or model families than the dense Llama we compare.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$REPO/.carry/vllm}
WORK=${WORK:-$REPO/.carry/vllm-work}
PART_MB=${PART_MB:-56}
PY=${PY:-python3}

PLATFORMS=()
for n in 39 35 34 31 28 27 24 17; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
TARGET=(--python-version 3.12 --implementation cp --only-binary=:all: "${PLATFORMS[@]}")

grep -q '^/.carry/$' "$REPO/.git/info/exclude" 2>/dev/null || echo /.carry/ >>"$REPO/.git/info/exclude"
rm -rf "$WORK" "$OUT"
mkdir -p "$WORK/wheels" "$WORK/site" "$OUT"

"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$WORK/wheels" \
  -r "$REPO/benchmarks/peers/vllm_requirements.txt"

# flashinfer-cubin without its cubins: the package must import (flashinfer looks for it), the
# Blackwell kernels are not needed on Hopper.
cubin=$(ls "$WORK"/wheels/flashinfer_cubin-*.whl)
mkdir -p "$WORK/cubin"
(cd "$WORK/cubin" && unzip -q "$cubin" -x 'flashinfer_cubin/cubins/*' && mkdir -p flashinfer_cubin/cubins)
rm "$cubin"

"$PY" -m pip install -q --no-deps --no-compile "${TARGET[@]}" --target "$WORK/site" "$WORK"/wheels/*.whl
cp -r "$WORK/cubin/"* "$WORK/site/"

site=$WORK/site
rm -f "$site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$site/vllm/vllm-rs"
rm -rf "$site/vllm/third_party/fmha_sm100"
find "$site/vllm/third_party/deep_gemm" -name '_C.cpython-3*' ! -name '*cpython-312*' -delete
find "$site" -name '__pycache__' -prune -exec rm -rf {} +

tar -C "$site" -cf - . | gzip -6 >"$WORK/vllm-site.tar.gz"
split -b "${PART_MB}M" -d -a 1 "$WORK/vllm-site.tar.gz" "$WORK/vllm-site.tar.gz.part"
i=0
for part in "$WORK"/vllm-site.tar.gz.part*; do
  i=$((i + 1))
  mkdir -p "$OUT/p$i"
  mv "$part" "$OUT/p$i/"
done
(cd "$WORK" && sha256sum vllm-site.tar.gz) >"$OUT/p$i/vllm-site.sha256"
du -sh "$OUT"/p*
echo "ready: $i parts; carry .carry/vllm/p1 .. .carry/vllm/p$i, one per device call"
