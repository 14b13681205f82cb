#!/usr/bin/env bash
# A short GPU round in one device call (~8 min), for a session with little device time left:
# the mixed-step graph tests, the online rows of pdserve again (with mixed-step graphs where
# their tests passed) (colocated, bf16 and FP8, the
# same prompts and rates as the recorded vLLM run of benchmarks/peers/README.md "Online"),
# then the model GPU tests. Carry out/pd_two_gpu_carry and .carry/tokenizer (see
# benchmarks/peers/online_round.sh). Each step has its own deadline; what finished is in $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
bash benchmarks/peers/online_round.sh setup
PER_FILE_S=${MIXED_TESTS_S:-100} bash benchmarks/gpu/run_gpu_tests.sh tests/gpu/test_mixed_graphs_gpu.py
# Mixed-step graphs on for our rows only where their tests passed on this GPU (the eager
# rows are recorded already); otherwise the eager rows again.
if grep -q "test_mixed_graphs_gpu rc=0 " "${OUT:-out}/gpu_tests_summary.txt" 2>/dev/null; then
  export PD_ARGS="--mixed-cuda-graphs=on" PD_LABEL=mixed
fi
PD_TIMEOUT=175 bash benchmarks/peers/online_round.sh pd colocated bf16
PD_TIMEOUT=175 bash benchmarks/peers/online_round.sh pd colocated fp8
PER_FILE_S=${MODEL_TESTS_S:-100} bash benchmarks/gpu/run_gpu_tests.sh tests/gpu/test_models_gpu.py
