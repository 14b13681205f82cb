#!/usr/bin/env bash
# The GPU proof of this round's new paths in one device call (~5 min): the mixed-step graph
# tests, one mixed step eager vs graphed (benchmarks.gpu.mixed_step), the FP8 fusion timings,
# and the model GPU tests (DeepSeek MLA, gpt-oss, MoE). Carry .carry/tokenizer.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
out=${OUT:-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PER_FILE_S=${MIXED_TESTS_S:-90} bash benchmarks/gpu/run_gpu_tests.sh tests/gpu/test_mixed_graphs_gpu.py
for b in mixed_step fp8_fusions; do
  start=$(date +%s)
  timeout "${BENCH_S:-75}" python3 -m "benchmarks.gpu.$b" --out "$out/$b.json" >"$out/$b.log" 2>&1
  echo "$b rc=$? $(( $(date +%s) - start ))s" | tee -a "$out/gpu_tests_summary.txt"
  tail -12 "$out/$b.log"
done
PER_FILE_S=${MODEL_TESTS_S:-90} bash benchmarks/gpu/run_gpu_tests.sh tests/gpu/test_models_gpu.py
