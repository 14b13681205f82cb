#!/usr/bin/env bash
# One GPU round of the online comparison (benchmarks/peers/README.md, "Online"), as a chain of
# device calls made back to back (the machine stays warm ~30 s between calls; /tmp survives
# while it does). Prepare here first:
#   bash benchmarks/gpu/pd_two_gpu_wheels.sh      # our server's wheels -> out/pd_two_gpu_carry
#   PART_MB=56 bash benchmarks/peers/vllm_carry.sh  # vLLM pack -> .carry/vllm/p1..p5
#   mkdir -p .carry/tokenizer && cp ~/.cache/pdserve/models/smollm2/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .carry/tokenizer/
# Then, on the GPU machine (from the repository root):
#   step setup   (carry out/pd_two_gpu_carry .carry/tokenizer): install our wheels into /tmp/site
#   step pd MODE PRECISION [PART]  (carry .carry/vllm/pK): stash part K, run pdserve online
#        (PD_ARGS: extra `pdserve up` flags, e.g. "--mixed-cuda-graphs=on"; PD_LABEL: a suffix
#        for the result's name, so such a run does not overwrite the default one;
#        PD_PROFILE=SECONDS: py-spy of pdserve up's processes for that long, starting
#        PD_PROFILE_DELAY (3) s after the load generator starts, to $OUT/profile-pdserve-LABEL.txt
#        and its summary .md (benchmarks/system/serving_profile.py); use it with RATES=40)
#   step stash K (carry .carry/vllm/pK): stash part K only
#   step vllm PRECISION: unpack vLLM once, run vllm online
# Each run writes $OUT/online_<label>.json (copied here into benchmarks/results/peers/online/).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
STATE=/tmp/pdserve-online
SITE=/tmp/site
mkdir -p "$STATE"
RATES=${RATES:-5,10,20,40}
PROMPTS=${PROMPTS:-200}
stash() { [ -n "${1:-}" ] && [ -d ".carry/vllm/p$1" ] && bash benchmarks/peers/vllm_install.sh stash ".carry/vllm/p$1" >/dev/null && echo "stashed p$1"; }
tok() { [ -d .carry/tokenizer ] && cp -r .carry/tokenizer "$STATE/" ; echo "$STATE/tokenizer"; }
profile_bg() {  # SECONDS OUT: py-spy of `pdserve up` and its children once the bench runs
  local secs=$1 out=$2 spy harness="" up=""
  spy=$(command -v py-spy || echo "$SITE/bin/py-spy")
  [ -x "$spy" ] || { echo "no py-spy: no profile" >&2; return 0; }
  sleep 5  # the harness starts; its children are the server and the load generator
  # anchored: the `timeout` wrapper's command line names the harness too
  harness=$(pgrep -f "^python[0-9.]* -m benchmarks.peers.online" | head -1)
  [ -n "$harness" ] || { echo "no online harness: no profile" >&2; return 0; }
  for _ in $(seq 900); do  # until the load generator runs (or the harness ended)
    pgrep -P "$harness" -f "pdserve bench serve" >/dev/null && break
    kill -0 "$harness" 2>/dev/null || return 0
    sleep 1
  done
  sleep "${PD_PROFILE_DELAY:-3}"
  up=$(pgrep -P "$harness" -f "pdserve up" | head -1)
  [ -n "$up" ] || { echo "no pdserve up process: no profile" >&2; return 0; }
  "$spy" record --pid "$up" --subprocesses --threads --idle --nonblocking --rate 100 \
    --duration "$secs" --format raw -o "$out" >/dev/null 2>&1 || echo "py-spy failed" >&2
  [ -s "$out" ] && python3 -m benchmarks.system.serving_profile "$out" > "${out%.txt}.md"
  return 0
}
step=${1:?step}
case "$step" in
  setup)
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    python3 -m pip install -q --no-deps --no-index --target "$SITE" out/pd_two_gpu_carry/wheels/*.whl 2>&1 | tail -3
    tok >/dev/null
    PYTHONPATH=$SITE:$PWD python3 -c 'import fastapi, grpc, httpx, tqdm, blake3, transformers; print("imports ok")'
    ;;
  pd)
    mode=${2:?mode}; precision=${3:?precision}; stash "${4:-}"
    label=$mode-$precision${PD_LABEL:+-$PD_LABEL}
    extra=()
    for a in ${PD_ARGS:-}; do extra+=("--server-arg=$a"); done
    [ -n "${PD_PROFILE:-}" ] && profile_bg "$PD_PROFILE" "$OUT/profile-pdserve-$label.txt" &
    PYTHONPATH=$SITE:$PWD timeout ${PD_TIMEOUT:-540} python3 -m benchmarks.peers.online --server pdserve --mode "$mode" \
      --precision "$precision" --rates "$RATES" --num-prompts "$PROMPTS" --tokenizer "$(tok)" \
      --workdir "$STATE/work" --log "$OUT/pdserve-$label.log" "${extra[@]}" \
      --variant "${PD_LABEL:-}" \
      --json "$OUT/online_pdserve-$label.json" 2>&1 | grep -v "^pdserve bench\|INFO" | tail -30
    wait  # the profile, if any
    ;;
  stash)
    stash "${2:?part}"
    ;;
  vllm)
    precision=${2:?precision}
    [ -d /tmp/vllm-site/vllm ] || bash benchmarks/peers/vllm_install.sh unpack || exit 1
    PYTHONPATH=$SITE:$PWD timeout 570 python3 -m benchmarks.peers.online --server vllm \
      --server-pythonpath "/tmp/vllm-site:$PWD" --precision "$precision" --rates "$RATES" \
      --num-prompts "$PROMPTS" --tokenizer "$(tok)" --workdir "$STATE/work" \
      --log "$OUT/vllm-$precision.log" --json "$OUT/online_vllm-$precision.json" 2>&1 | tail -30
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
