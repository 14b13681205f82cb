#!/usr/bin/env bash
# One H200 round of the peer comparison, as a chain of device calls made back to back (the
# machine stays warm ~30 s between calls; /tmp survives while it does). Each call carries one
# part of the vLLM pack (benchmarks/peers/vllm_carry.sh) and does one step's GPU work:
#
#   step 1 (carry .carry/vllm/p1): tune the split-K FP8 GEMM, then our FP8 rows with its table
#   step 2 (carry .carry/vllm/p2): our bf16 rows
#   step 3 (carry .carry/vllm/p3): deterministic mode's cost
#   step 4 (carry .carry/vllm/p4): nothing more (the part only)
#   step 5 (carry .carry/vllm/p5): unpack vLLM, vLLM bf16 rows
#   step 6 (carry .carry/tokenizer): vLLM FP8 rows, then this round's GPU tests (the tiny
#          models take the carried tokenizer; it does not fit beside a 56 MiB part)
#
# Results go to $OUT (copied back into benchmarks/results/ here). Run from the repository root
# on the GPU machine: bash benchmarks/peers/h200_round.sh STEP
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
STATE=/tmp/pdserve-round
mkdir -p "$STATE"
step=${1:?step}
stash() { [ -d ".carry/vllm/p$1" ] && bash benchmarks/peers/vllm_install.sh stash ".carry/vllm/p$1" >/dev/null && echo "stashed p$1"; }
table=engine/models/fp8_gemm_configs.json
# A table tuned in step 1 stays in $STATE for the later steps' fresh working-tree copies.
[ -f "$STATE/fp8_gemm_configs.json" ] && [ ! -f "$table" ] && cp "$STATE/fp8_gemm_configs.json" "$table"
case "$step" in
  1)
    stash 1
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    timeout 330 python3 -m benchmarks.gpu.fp8_gemm_tune --write --json "$OUT/fp8_gemm_tune_h200.json" 2>&1 | grep -v "^  skip"
    [ -f "$table" ] && cp "$table" "$STATE/" && cp "$table" "$OUT/"
    python3 -m benchmarks.peers.offline --engine pdserve --precision fp8 --json "$OUT/pdserve_fp8.json" 2>&1 | tail -25
    ;;
  2)
    stash 2
    python3 -m benchmarks.peers.offline --engine pdserve --precision bf16 --json "$OUT/pdserve_bf16.json" 2>&1 | tail -25
    ;;
  3)
    stash 3
    timeout 150 python3 -m benchmarks.gpu.deterministic_cost --device cuda --out "$OUT/deterministic_cost_h200.json" 2>&1 | tail -15
    ;;
  4)
    stash 4
    ;;
  5)
    stash 5
    bash benchmarks/peers/vllm_install.sh unpack || exit 1
    PYTHONPATH=/tmp/vllm-site:. python3 -m benchmarks.peers.offline --engine vllm --precision bf16 --json "$OUT/vllm_bf16.json" 2>&1 | tail -25
    ;;
  6)
    PYTHONPATH=/tmp/vllm-site:. python3 -m benchmarks.peers.offline --engine vllm --precision fp8 --json "$OUT/vllm_fp8.json" 2>&1 | tail -25
    export PDSERVE_TEST_TOKENIZER_DIR=$PWD/.carry/tokenizer
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 120 \
      tests/gpu/test_fp8_gemm_gpu.py tests/gpu/test_deterministic_gpu.py tests/gpu/test_host_tier_gpu.py \
      tests/gpu/test_lora_gpu.py tests/gpu/test_models_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
