#!/usr/bin/env bash
# Issue 35's GPU round: the mixed-step CUDA graphs and the FP8 fusions, tests then timings.
#   bash benchmarks/gpu/issue35_round.sh [tests|bench|all]      (default all, ~8 min)
# Logs and JSON go to $OUT (or ./out): the test logs and summary of run_gpu_tests.sh, then
# mixed_step.json, fp8_kv_attention.json, fp8_fusions.json (copy them to
# benchmarks/results/gpu/<name>_<h100|h200>.json) with a .log beside each.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
out=${OUT:-out}
mkdir -p "$out"
phase=${1:-all}
if [ "$phase" = tests ] || [ "$phase" = all ]; then
  PER_FILE_S=${PER_FILE_S:-240} bash benchmarks/gpu/run_gpu_tests.sh \
    tests/gpu/test_mixed_graphs_gpu.py tests/gpu/test_fp8_fused_gpu.py \
    tests/gpu/test_kv_fp8_gpu.py tests/gpu/test_cuda_graphs.py tests/gpu/test_engine_gpu.py
fi
if [ "$phase" = bench ] || [ "$phase" = all ]; then
  for b in mixed_step fp8_kv_attention fp8_fusions; do
    start=$(date +%s)
    timeout 240 python3 -m "benchmarks.gpu.$b" --out "$out/$b.json" >"$out/$b.log" 2>&1
    echo "$b rc=$? $(( $(date +%s) - start ))s" | tee -a "$out/gpu_tests_summary.txt"
  done
fi
