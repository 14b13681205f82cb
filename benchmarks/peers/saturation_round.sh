#!/usr/bin/env bash
# The online comparison up to saturation, on one GPU, as a chain of device calls made back to
# back (benchmarks/peers/README.md, "Online, up to saturation"): 600 prompts of the mixed set
# at 40, 80, 120 and 160 req/s, so that the top rates queue on both servers; our server at
# its defaults and in two variants (a vLLM-sized batch: 1,024 requests and 8,192 tokens a step;
# FP8 with per-tensor scales), then `vllm serve` at its defaults. Prepare as
# benchmarks/peers/online_round.sh says, then, on the GPU machine:
#   call 1 (carry out/pd_two_gpu_carry .carry/tokenizer): saturation_round.sh first
#   call 2 (carry .carry/vllm/p1):  saturation_round.sh pd bf16 big 1
#   call 3 (carry .carry/vllm/p2):  saturation_round.sh pd fp8 default 2
#   call 4 (carry .carry/vllm/p3):  saturation_round.sh pd fp8 tensor 3
#   call 5 (carry .carry/vllm/p4):  saturation_round.sh stash 4
#   call 6 (carry .carry/vllm/p5):  saturation_round.sh vllm bf16 5
#   call 7:                         saturation_round.sh vllm fp8
# `first` checks the GPU kernels changed since the last GPU run (attention launch choice, the
# FP8 tests whose bounds moved), then runs our bf16 at its defaults. Results: $OUT/online_*.json,
# copied here into benchmarks/results/peers/online/<gpu>_saturation/.
set -uo pipefail
export RATES=${RATES:-40,80,120,160} PROMPTS=${PROMPTS:-600}
round=benchmarks/peers/online_round.sh
big="--max-num-seqs=1024 --max-num-batched-tokens=8192"

pd() {  # PRECISION VARIANT [PART]
  local precision=$1 variant=$2 part=${3:-}
  case "$variant" in
    default) bash "$round" pd colocated "$precision" "$part" ;;
    big) PD_ARGS=$big PD_LABEL=big bash "$round" pd colocated "$precision" "$part" ;;
    tensor) PD_ARGS="--fp8-scales=tensor" PD_LABEL=tensor bash "$round" pd colocated "$precision" "$part" ;;
    *) echo "unknown variant $variant" >&2; return 2 ;;
  esac
}

case "${1:?step}" in
  first)
    bash "$round" setup
    PYTHONPATH=/tmp/site:$PWD timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu \
      --timeout 120 tests/gpu/test_triton_attention.py tests/gpu/test_fp8_tensor_gpu.py \
      tests/gpu/test_fp8_fused_gpu.py >"${OUT:-out}/gpu_tests_changed.log" 2>&1
    echo "changed-kernel GPU tests rc=$? $(tail -1 "${OUT:-out}/gpu_tests_changed.log")"
    pd bf16 default
    ;;
  pd) pd "${2:?precision}" "${3:?variant}" "${4:-}" ;;
  stash) bash "$round" stash "${2:?part}" ;;
  vllm)
    [ -n "${3:-}" ] && bash "$round" stash "$3"
    bash "$round" vllm "${2:?precision}"
    ;;
  *) echo "unknown step $1" >&2; exit 2 ;;
esac
