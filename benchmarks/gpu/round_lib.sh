#!/usr/bin/env bash
# Shared by the GPU round scripts (source it from the repository root): the environment
# every process there needs, $out, $gpu (h100 / h200 / the card's name) and `step`, which
# runs one command under a deadline with its log in $out and a line in $out/summary.txt.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
[ -d .carry/tokenizer ] && export PDSERVE_TEST_TOKENIZER_DIR=$PWD/.carry/tokenizer
out=${OUT:-out}
mkdir -p "$out"
name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$name" in
  *H200*) gpu=h200 ;;
  *H100*) gpu=h100 ;;
  *) gpu=$(echo "${name:-gpu}" | tr -c 'A-Za-z0-9\n' '_' | tr 'A-Z' 'a-z') ;;
esac
echo "GPU: $name ($gpu)" | tee -a "$out/summary.txt"

step() {  # step NAME SECONDS COMMAND...
  local label=$1 limit=$2
  shift 2
  local start
  start=$(date +%s)
  timeout "$limit" "$@" >"$out/$label.log" 2>&1
  local rc=$?
  echo "$label rc=$rc $(($(date +%s) - start))s $(tail -1 "$out/$label.log")" | tee -a "$out/summary.txt"
}
