#!/usr/bin/env bash
# The engine core in a process of its own against the engine thread, online on one GPU
# (docs/design.md §3 "Engine thread or engine process"; benchmarks/peers/README.md "Online,
# up to saturation"), as device calls made back to back. Prepare as
# benchmarks/peers/online_round.sh says, then, on the GPU machine:
#   call 1 (carry out/pd_two_gpu_carry .carry/tokenizer): engine_process_round.sh first
#   call 2:                                               engine_process_round.sh ab
#   call 3 (a cold machine: setup first, as call 1's carry):  engine_process_round.sh fp8
# `first` sets up, runs the GPU tests of the kernels and start-up paths changed since the last
# GPU run (the eager-shape warm-up, the FP8 quantization kernels' shared helpers, the
# attention launch choice), then our bf16 server with the vLLM-sized batch in a process of
# its own at 80 req/s with a py-spy profile of every process. `ab` runs that server with the
# engine on a thread and in its own process, one after the other, at $RATES (default 80,120).
# Then the vLLM rows of the same kind: saturation_round.sh's calls (stash 1-5, vllm bf16).
# Results: $OUT/online_*.json, copied here into benchmarks/results/peers/online/<gpu>_saturation/.
set -uo pipefail
export PROMPTS=${PROMPTS:-600}
round=benchmarks/peers/online_round.sh
big="--max-num-seqs=1024 --max-num-batched-tokens=8192"

case "${1:?step}" in
  first)
    bash "$round" setup
    PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
      --timeout 200 tests/gpu/test_engine_gpu.py tests/gpu/test_fp8_tensor_gpu.py \
      tests/gpu/test_fp8_fused_gpu.py tests/gpu/test_fp8_gpu.py tests/gpu/test_cuda_graphs.py \
      tests/gpu/test_triton_attention.py >"${OUT:-out}/gpu_tests.log" 2>&1
    echo "GPU tests rc=$? $(tail -1 "${OUT:-out}/gpu_tests.log")"
    grep -E "^FAILED|Error:" "${OUT:-out}/gpu_tests.log" | head -10
    RATES=80 PD_PROFILE=12 PD_ARGS="$big --engine-process=on" PD_LABEL=big-process \
      PD_TIMEOUT=240 bash "$round" pd colocated bf16
    ;;
  ab)
    # 80 first: the profile (PD_PROFILE seconds, 0 = none) covers it
    export RATES=${RATES:-80,120,160,40}
    for way in thread process; do
      on=$([ "$way" = process ] && echo on || echo off)
      PD_ARGS="$big --engine-process=$on" PD_LABEL=big-$way PD_TIMEOUT=280 \
        PD_PROFILE=${PD_PROFILE:-10} bash "$round" pd colocated bf16
    done
    ;;
  fp8)
    # FP8 (per-tensor scales) in the engine process at $RATES, then (AGAIN=1) bf16 at 80 again
    RATES=${RATES:-80,120,160,40} PD_ARGS="$big --fp8-scales=tensor --engine-process=on" \
      PD_LABEL=big-tensor-process PD_TIMEOUT=230 bash "$round" pd colocated fp8
    [ "${AGAIN:-1}" = 1 ] && RATES=80 PD_ARGS="$big --engine-process=on" \
      PD_LABEL=big-process-again PD_TIMEOUT=120 bash "$round" pd colocated bf16
    ;;
  *) echo "unknown step $1" >&2; exit 2 ;;
esac
