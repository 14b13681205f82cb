#!/usr/bin/env bash
# The re-checks after the first GPU round of 2026-12-06, on one GPU (H100 80GB or H200), in
# two calls of at most ~6 minutes each. Carry .carry/tokenizer. Results in $OUT (or ./out),
# one log per step and summary.txt with a line per step.
#   bash benchmarks/gpu/recheck_round.sh tests   # gpt-oss vs transformers, LoRA kernels,
#                                                # the FP8 paths with fp16 KV tiles and
#                                                # mixed-step graphs on (the new defaults)
#   bash benchmarks/gpu/recheck_round.sh bench   # LoRA 8 adapters vs base, Mixtral-8x7B FP8
#                                                # rows, the split-K FP8 GEMM table for this GPU
set -uo pipefail
# shellcheck source=benchmarks/gpu/round_lib.sh
source benchmarks/gpu/round_lib.sh

case "${1:-tests}" in
  tests)
    step models_gpu_$gpu 100 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 90 \
      tests/gpu/test_models_gpu.py
    step lora_gpu_$gpu 100 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 90 \
      tests/gpu/test_lora_gpu.py $(ls tests/gpu/test_lora_*gpu.py 2>/dev/null | grep -v test_lora_gpu.py)
    step fp8_gpu_$gpu 150 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 140 \
      tests/gpu/test_kv_fp8_gpu.py tests/gpu/test_fp8_gpu.py tests/gpu/test_mixed_graphs_gpu.py \
      tests/gpu/test_fp8_fused_gpu.py
    ;;
  bench)
    step lora_kernels_$gpu 60 python3 -m benchmarks.gpu.lora_kernels --out "$out/lora_kernels_$gpu.json"
    step lora_step_$gpu 90 python3 -m benchmarks.gpu.lora_step --device cuda --steps 16 \
      --out "$out/lora_step_$gpu.json"
    step moe_models_$gpu 200 python3 -m benchmarks.gpu.moe_models --models mixtral-8x7b:fp8 \
      --prompts 16 --new-tokens 128 --json "$out/moe_models_${gpu}_mixtral.json"
    step fp8_gemm_tune_$gpu 150 python3 -m benchmarks.gpu.fp8_gemm_tune --write \
      --json "$out/fp8_gemm_tune_$gpu.json"
    cp engine/models/fp8_gemm_configs.json "$out/fp8_gemm_configs.json"
    ;;
  *) echo "usage: $0 tests|bench" >&2; exit 2 ;;
esac
