#!/usr/bin/env bash
# On the GPU machine (one H100/H200), with NIXL carried by benchmarks/gpu/nixl_wheels.sh:
# the nixl GPU tests, then the handoff of a 4k-token prompt of the Llama-3.1-8B shape (dummy
# weights, bf16 KV: 512 MiB) between two engine processes on the one GPU, nixl (UCX CUDA
# IPC) beside p2p (our CUDA IPC copy). Results: $OUT/nixl_handoff_gpu.{json,md} and the
# test log; copy the json/md to benchmarks/results/kv/ with the card named.
#   bash benchmarks/gpu/nixl_handoff_gpu.sh [tests|bench|all]   (default all; each stage
#   ends within 5 min (tests) or 7 min (bench) of its start, so one device call holds either;
#   the bench writes its json/md after each connector, so p2p's row survives a nixl stall)
set -uo pipefail
stage=${1:-all}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
out=${OUT:-out}
mkdir -p "$out" /tmp/nixl
carry=${NIXL_CARRY:-out/nixl_carry}
# the GPU machine has no unzip: Python's zipfile extracts it
python3 -m zipfile -e "$carry/nixl.zip" /tmp/nixl
export PYTHONPATH=$PWD:/tmp/nixl${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import nixl_cu13; print("nixl", nixl_cu13.__file__)' || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
if [ "$stage" != bench ]; then
timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 240 \
  tests/gpu/test_nixl_gpu.py >"$out/test_nixl_gpu.log" 2>&1
echo "test_nixl_gpu rc=$? $(tail -1 "$out/test_nixl_gpu.log")"
fi
[ "$stage" = tests ] && exit 0
timeout 420 python3 -m benchmarks.kv.p2p_handoff_gpu --connectors p2p,nixl \
  --prompt-len 4096 --repeats 5 --json "$out/nixl_handoff_gpu.json" --md "$out/nixl_handoff_gpu.md"
echo "bench rc=$?"
