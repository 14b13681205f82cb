#!/usr/bin/env bash
# The GPU test files, each in its own Python process (an engine one file leaves allocated
# cannot starve the next), with a deadline per file. Logs go to $OUT (or ./out): one per
# file and a summary line per file in gpu_tests_summary.txt.
#   bash benchmarks/gpu/run_gpu_tests.sh [FILE ...]    (default: every tests/gpu/test_*.py)
# The tiny models take the tokenizer from .carry/tokenizer (docs/testing.md "GPU tests").
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
[ -d .carry/tokenizer ] && export PDSERVE_TEST_TOKENIZER_DIR=$PWD/.carry/tokenizer
out=${OUT:-out}
mkdir -p "$out"
per_file_s=${PER_FILE_S:-150}
files=("$@")
[ ${#files[@]} -eq 0 ] && files=(tests/gpu/test_*.py)
for f in "${files[@]}"; do
  name=$(basename "$f" .py)
  start=$(date +%s)
  timeout "$per_file_s" python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 120 "$f" \
    >"$out/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s $(tail -1 "$out/$name.log")" | tee -a "$out/gpu_tests_summary.txt"
done
