#!/usr/bin/env bash
# The mixed-set profiles of issue 35 (benchmarks/peers/profile_mixed.py): ours bf16 and fp8,
# then vLLM bf16 and fp8, each a process under its own `timeout`, then the side-by-side
# tables (profile_compare.py). Run from the repository root on the GPU machine.
#
# vLLM travels in 5 parts (benchmarks/peers/vllm_carry.sh -> .carry/vllm/p1..p5) that wait
# in /tmp while the machine stays warm between calls. One round, as device calls made back
# to back:
#   bash benchmarks/gpu/profile_round.sh stash 1      (carry .carry/vllm/p1)   ... 2, 3, 4
#   bash benchmarks/gpu/profile_round.sh all 5        (carry .carry/vllm/p5)
# `all [K]` stashes part K, then runs the four profiles within ROUND_S seconds (default 470):
# a profile that cannot finish in what is left is skipped, saying which step runs it in a
# following call (`pd PRECISION|both`, `vllm PRECISION|both`). Every result stays in
# /tmp/pdserve-profile as well, so the tables pair runs made by different calls. With more
# slack per call: `pd both 1` (carry p1: stash it, then ours), `stash 2` .. `stash 4`,
# `vllm both 5` (carry p5: stash it, unpack, then vLLM's).
# Output under $OUT/profile/: <engine>_<precision>.{json,md,log}, compare.md.
# NUM_PROMPTS (default 300: the first 300 requests of the mixed set, ~60 s of profile per
# engine), PD_ARGS (extra profile_mixed.py flags for ours, e.g. "--graphs off") and
# EXTRA_ARGS (for both; a dry run of this script on a CPU machine:
# OUT=/tmp/o NUM_PROMPTS=2 EXTRA_ARGS="--device cpu --max-output 4" bash ... pd bf16) apply.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUTDIR=${OUT:-out}/profile
STATE=/tmp/pdserve-profile
mkdir -p "$OUTDIR" "$STATE"
NUM_PROMPTS=${NUM_PROMPTS:-300}
ROUND_S=${ROUND_S:-470}
START=$(date +%s)
# Seconds each profile needs at least (build + warm-up + two runs) and may take at most.
PD_NEED=${PD_NEED:-90} PD_MAX=${PD_MAX:-200}
VLLM_NEED=${VLLM_NEED:-180} VLLM_MAX=${VLLM_MAX:-330}

left() { echo $(( ROUND_S - ($(date +%s) - START) )); }
stash() { [ -d ".carry/vllm/p$1" ] && bash benchmarks/peers/vllm_install.sh stash ".carry/vllm/p$1" >/dev/null && echo "stashed p$1"; }
precisions() { case "${1:-both}" in both) echo bf16 fp8 ;; *) echo "$1" ;; esac; }

# profile ENGINE PRECISION NEED MAX: one profile under `timeout`, unless it cannot fit.
profile() {
  local engine=$1 precision=$2 need=$3 max=$4 budget extra=() more=() pypath=.
  budget=$(left)
  if [ "$budget" -lt "$need" ]; then
    echo "SKIPPED $engine $precision (${budget}s left of ROUND_S=$ROUND_S, needs ${need}s):" \
      "run 'bash benchmarks/gpu/profile_round.sh ${engine/pdserve/pd} $precision' in the next call" \
      | tee -a "$OUTDIR/skipped.txt"
    return 0
  fi
  [ "$budget" -gt "$max" ] && budget=$max
  if [ "$engine" = vllm ]; then pypath=/tmp/vllm-site:.; else read -ra extra <<<"${PD_ARGS:-}"; fi
  read -ra more <<<"${EXTRA_ARGS:-}"
  local base="$OUTDIR/${engine}_${precision}" t0
  t0=$(date +%s)
  PYTHONPATH=$pypath timeout "$budget" python3 -m benchmarks.peers.profile_mixed --engine "$engine" \
    --precision "$precision" --num-prompts "$NUM_PROMPTS" --json "$base.json" "${extra[@]}" "${more[@]}" >"$base.log" 2>&1
  local rc=$?
  echo "$engine $precision rc=$rc $(( $(date +%s) - t0 ))s (timeout ${budget}s)" | tee -a "$OUTDIR/summary.txt"
  if [ -f "$base.json" ]; then cp "$base.json" "$STATE/"; cat "$base.md"; else tail -25 "$base.log"; fi
}

run_pd() { for p in $(precisions "${1:-both}"); do profile pdserve "$p" "$PD_NEED" "$PD_MAX"; done; }
run_vllm() {
  if [ ! -d /tmp/vllm-site/vllm ]; then
    bash benchmarks/peers/vllm_install.sh unpack 2>&1 | tail -3
    [ -d /tmp/vllm-site/vllm ] || { echo "vLLM not unpacked: stash parts 1-5 first" | tee -a "$OUTDIR/summary.txt"; return 1; }
  fi
  for p in $(precisions "${1:-both}"); do profile vllm "$p" "$VLLM_NEED" "$VLLM_MAX"; done
}
compare() {
  ls "$STATE"/vllm_*.json >/dev/null 2>&1 || { echo "no vLLM profile yet: the tables follow its step"; return 0; }
  python3 -m benchmarks.peers.profile_compare --dir "$STATE" --md "$OUTDIR/compare.md" 2>&1 | tail -60
}

step=${1:?step: stash K | pd [PRECISION|both] [K] | vllm [PRECISION|both] [K] | all [K] | compare}
case "$step" in
  stash) stash "${2:?part}" ;;
  pd)
    [ -n "${3:-}" ] && stash "$3"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    run_pd "${2:-both}"
    compare
    ;;
  vllm) [ -n "${3:-}" ] && stash "$3"; run_vllm "${2:-both}"; compare ;;
  all)
    [ -n "${2:-}" ] && stash "$2"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    run_pd both
    run_vllm both
    compare
    ;;
  compare) compare ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
