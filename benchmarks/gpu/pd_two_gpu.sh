#!/usr/bin/env bash
# Two-GPU disaggregation benchmark (issue 8), one command:
#   pd-fs      1 prefill on GPU 0 + 1 decode on GPU 1, KV through the fs connector on /dev/shm
#   pd-redis   the same, KV through a redis-server on loopback
#   colocated  2 colocated replicas, one per GPU, behind the same router
# Llama-3.1-8B shape with dummy bf16 weights, the same Poisson workload for each (4k-token
# prompts, 256-token outputs, several rates). Writes $JSON (default on GPUs: the committed
# benchmarks/results/gpu/pd_two_gpu.json; with --cpu: $OUT/pd_two_gpu.json), $OUT/pd_two_gpu.md
# and $OUT/pd_two_gpu_logs.tar.gz (child logs and the raw bench serve JSON).
#
#   bash benchmarks/gpu/pd_two_gpu.sh         on a machine with 2 GPUs (nvidia-h200-x2); bounded
#                                             by BUDGET_S (default 520 s): one 10-minute call
#   bash benchmarks/gpu/pd_two_gpu.sh --cpu   the same pipeline on the CPU: a tiny body with the
#                                             8B vocabulary, short workload (a dry run)
#
# Python packages the GPU image lacks travel as wheels in $CARRY/wheels and redis-server in
# $CARRY/redis (made by benchmarks/gpu/pd_two_gpu_wheels.sh); they are installed/used when
# present. Knobs (environment): OUT JSON CARRY BUDGET_S RATES NUM_PROMPTS DURATION_S
# NUM_WARMUPS INPUT_LEN OUTPUT_LEN TPOT_SLO_MS TPOT_GRID CONFIGS ("pd-fs colocated pd-redis") PY.
set -uo pipefail

MODE=gpu
case "${1:-}" in
  --cpu | --dry-run) MODE=cpu ;;
  "") ;;
  *) echo "usage: $0 [--cpu]" >&2; exit 2 ;;
esac

REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO" || exit 2
OUT=${OUT:-$REPO/out/pd_two_gpu-$MODE}
if [ "$MODE" = gpu ]; then JSON=${JSON:-$REPO/benchmarks/results/gpu/pd_two_gpu.json}; fi
JSON=${JSON:-$OUT/pd_two_gpu.json}
CARRY=${CARRY:-$REPO/out/pd_two_gpu_carry}
WORK=$(mktemp -d /tmp/pd_two_gpu.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
START=$(date +%s)
LOG="$WORK/run.log"
log() { echo "[pd_two_gpu $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
elapsed() { echo $(($(date +%s) - START)); }
fail_early() {  # a report that says why nothing ran, then exit 1
  log "$1"
  printf '# Two-GPU disaggregation benchmark: not run\n\n%s: %s\n' \
    "$(date -u +%Y-%m-%dT%H:%MZ)" "$1" >"$OUT/pd_two_gpu.md"
  cp "$LOG" "$OUT/pd_two_gpu_run.log"
  exit 1
}

if [ "$MODE" = gpu ]; then
  PY=${PY:-python3}
  BUDGET_S=${BUDGET_S:-520}
  RATES=${RATES:-1,2,4}
  NUM_PROMPTS=${NUM_PROMPTS:-32}
  DURATION_S=${DURATION_S:-12}
  NUM_WARMUPS=${NUM_WARMUPS:-3}
  INPUT_LEN=${INPUT_LEN:-4096}
  OUTPUT_LEN=${OUTPUT_LEN:-256}
  TPOT_SLO_MS=${TPOT_SLO_MS:-25}
  REQUEST_TIMEOUT=${REQUEST_TIMEOUT:-60}
  STARTUP_S=${STARTUP_S:-200}
  MIN_CONFIG_S=${MIN_CONFIG_S:-150}
  CONFIG_JSON=benchmarks/configs/llama-3.1-8b/config.json
  ENGINE=(--device cuda --gpus 2 --dtype bfloat16 --attention-backend triton
    --max-num-seqs 64 --max-num-batched-tokens 4096)
  KV_DTYPE_BYTES=2
  # NVLink multicast stays off on these hosts (KINDS.md), also in every child we start.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
else
  PY=${PY:-$REPO/.venv/bin/python}
  BUDGET_S=${BUDGET_S:-900}
  RATES=${RATES:-2,4}
  NUM_PROMPTS=${NUM_PROMPTS:-6}
  DURATION_S=${DURATION_S:-3}
  NUM_WARMUPS=${NUM_WARMUPS:-1}
  INPUT_LEN=${INPUT_LEN:-4096}
  OUTPUT_LEN=${OUTPUT_LEN:-16}
  TPOT_SLO_MS=${TPOT_SLO_MS:-300}
  REQUEST_TIMEOUT=${REQUEST_TIMEOUT:-120}
  STARTUP_S=${STARTUP_S:-180}
  MIN_CONFIG_S=${MIN_CONFIG_S:-60}
  CONFIG_JSON=benchmarks/configs/llama-3.1-8b/config.json
  ENGINE=(--device cpu --dtype float32 --torch-threads 1 --kv-cache-memory 256M
    --max-num-seqs 8 --max-num-batched-tokens 4096)
  KV_DTYPE_BYTES=4
fi
CONFIGS=${CONFIGS:-pd-fs colocated pd-redis}
MAX_MODEL_LEN=$((INPUT_LEN + OUTPUT_LEN + 256))
SEED=${SEED:-1234}

# --- environment: carried wheels and redis-server -------------------------------------------
# (GPU mode only: the wheels are for the GPU image's Python; a CPU run uses its own venv.)
if [ "$MODE" = gpu ] && ls "$CARRY"/wheels/*.whl >/dev/null 2>&1; then
  log "installing carried wheels from $CARRY/wheels"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$WORK/site" "$CARRY"/wheels/*.whl >>"$LOG" 2>&1; then
    tail -20 "$LOG"; fail_early "pip install of the carried wheels failed: $(tail -1 "$LOG")"
  fi
  export PYTHONPATH="$REPO:$WORK/site"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
[ -x "$CARRY/redis/bin/redis-server" ] && export PATH="$CARRY/redis/bin:$PATH"
export PYTHONUNBUFFERED=1 PDSERVE_LOG_LEVEL=${PDSERVE_LOG_LEVEL:-INFO}

log "mode $MODE, python $("$PY" -c 'import sys; print(sys.version.split()[0])'), budget ${BUDGET_S}s"
if ! "$PY" - >>"$LOG" 2>&1 <<EOF
import importlib, sys
missing = []
for name in ("torch", "fastapi", "uvicorn", "pydantic", "starlette", "redis", "grpc",
             "grpc_health", "google.protobuf", "prometheus_client", "httpx", "tokenizers", "xxhash",
             "transformers", "jinja2"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", ""))
    except Exception as exc:  # noqa: BLE001 - report every missing piece at once
        missing.append(f"{name} ({exc})")
if missing:
    sys.exit("missing Python packages: " + ", ".join(missing))
import torch
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
if "$MODE" == "gpu" and len(names) < 2:
    sys.exit(f"need 2 GPUs, torch sees {len(names)}")
with open("$WORK/facts", "w") as facts:
    facts.write((", ".join(names) or "none (CPU)") + "\n" + torch.__version__ + "\n")
EOF
then
  fail_early "preflight failed: $(tail -1 "$LOG")"
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L >>"$LOG" 2>&1
GPU_NAMES=$(sed -n 1p "$WORK/facts") TORCH_VERSION=$(sed -n 2p "$WORK/facts")

MODEL="$WORK/model"
TINY=(); [ "$MODE" = cpu ] && TINY=(--tiny)
"$PY" -m benchmarks.gpu.pd_two_gpu_report model --config "$CONFIG_JSON" --out "$MODEL" "${TINY[@]}" \
  >>"$LOG" 2>&1 || fail_early "could not build the model directory: $(tail -1 "$LOG")"

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# fs store on /dev/shm, bounded well inside what it has free (GC keeps the store at the
# bound); a /dev/shm too small for a few 4k-token prompts (512 MiB of KV each) means disk.
SHM_FREE_MB=$(df -Pm /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')
KV_DIR=/dev/shm/pdserve-kv-$$ KV_WHERE="/dev/shm (tmpfs)"
if [ "${SHM_FREE_MB:-0}" -lt 4096 ]; then
  KV_DIR="$WORK/kv" KV_WHERE="$WORK/kv on disk: /dev/shm had only ${SHM_FREE_MB:-0} MiB free"
  SHM_FREE_MB=$(df -Pm "$WORK" | awk 'NR==2 {print $4}')
fi
FS_CAP_MB=$((SHM_FREE_MB / 2)); [ "$FS_CAP_MB" -gt 16384 ] && FS_CAP_MB=16384
log "fs store: $KV_WHERE, capacity ${FS_CAP_MB} MiB"

# --- one configuration: pdserve up, wait for ready, bench serve, stop ---------------------
UP_PID=""
stop_up() {
  [ -n "$UP_PID" ] || return 0
  kill -TERM "$UP_PID" 2>/dev/null
  for _ in $(seq 1 60); do kill -0 "$UP_PID" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$UP_PID" 2>/dev/null
  wait "$UP_PID" 2>/dev/null
  UP_PID=""
}
REDIS_PID=""
stop_redis() {
  [ -n "$REDIS_PID" ] || return 0
  kill -TERM "$REDIS_PID" 2>/dev/null
  for _ in $(seq 1 20); do kill -0 "$REDIS_PID" 2>/dev/null || break; sleep 0.25; done
  kill -KILL "$REDIS_PID" 2>/dev/null
  wait "$REDIS_PID" 2>/dev/null
  REDIS_PID=""
}
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() { stop_up; stop_redis; rm -rf "$KV_DIR" "$WORK"; }
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

REDIS_URL="" REDIS_ERR=""
start_redis() {  # sets REDIS_URL, or REDIS_ERR; the store is a cache: no persistence, LRU at a bound
  local port; port=$(free_port)
  command -v redis-server >/dev/null || { REDIS_ERR="redis-server not found"; return 1; }
  log "redis-server: $(command -v redis-server), port $port"
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
    --maxmemory "${REDIS_MAXMEMORY:-24gb}" --maxmemory-policy allkeys-lru \
    --dir "$WORK" >"$WORK/pd-redis/redis.log" 2>&1 &
  REDIS_PID=$!
  for _ in $(seq 1 40); do
    if "$PY" -c "import socket,sys; s=socket.create_connection(('127.0.0.1',$port),1); s.sendall(b'PING\r\n'); sys.exit(0 if s.recv(16).startswith(b'+PONG') else 1)" 2>/dev/null; then
      REDIS_URL="redis://127.0.0.1:$port/0"; return 0
    fi
    kill -0 "$REDIS_PID" 2>/dev/null || break
    sleep 0.25
  done
  REDIS_ERR="redis-server did not answer PING: $(tail -3 "$WORK/pd-redis/redis.log" | tr '\n' ' ')"
  stop_redis; return 1
}

run_config() {
  local name=$1 dir="$WORK/$1" port t0 left bench_limit
  mkdir -p "$dir/logs"
  left=$((BUDGET_S - $(elapsed)))
  if [ "$left" -lt "$MIN_CONFIG_S" ]; then
    echo "skipped: ${left}s of the ${BUDGET_S}s budget left (needs ${MIN_CONFIG_S}s)" >"$dir/status"
    log "$name skipped (budget)"; return
  fi
  local up_args=()
  case "$name" in
    pd-fs) up_args=(--mode disaggregated --prefill 1 --decode 1 --connector fs
      --kv-path "$KV_DIR" --kv-capacity "${FS_CAP_MB}MiB" --kv-ttl 600) ;;
    pd-redis)
      if ! start_redis; then
        echo "failed: $REDIS_ERR" >"$dir/status"; log "$name: $REDIS_ERR"; return
      fi
      up_args=(--mode disaggregated --prefill 1 --decode 1 --connector redis
        --redis-url "$REDIS_URL" --kv-ttl 600) ;;
    colocated) up_args=(--mode colocated --prefill 0 --decode 2) ;;
    *) echo "failed: unknown configuration" >"$dir/status"; return ;;
  esac
  port=$(free_port)
  t0=$(date +%s)
  log "$name: pdserve up on port $port: ${up_args[*]}"
  "$PY" -m pdserve up --model "$MODEL" --port "$port" --load-format dummy \
    --max-model-len "$MAX_MODEL_LEN" "${ENGINE[@]}" "${up_args[@]}" \
    --startup-timeout "$STARTUP_S" --shutdown-grace 10 --log-dir "$dir/logs" \
    >"$dir/up.out" 2>&1 &
  UP_PID=$!
  local ready=0
  while [ $(($(date +%s) - t0)) -lt $((STARTUP_S + 15)) ]; do
    if grep -q "pdserve is ready" "$dir/up.out"; then ready=1; break; fi
    kill -0 "$UP_PID" 2>/dev/null || break
    sleep 1
  done
  if [ "$ready" != 1 ]; then
    echo "failed: not ready after $(($(date +%s) - t0))s: $(tail -c 600 "$dir/up.out" | tr '\n' ' ')" >"$dir/status"
    log "$name did not start"; tail -20 "$dir/up.out" | tee -a "$LOG"; stop_up; stop_redis; return
  fi
  local startup=$(($(date +%s) - t0))
  local placement; placement=$(sed -n 's/.* \([a-z]*-[0-9]*\) on GPU \([0-9]*\).*/\1 on GPU \2/p' "$dir/up.out" | paste -sd, -)
  log "$name ready after ${startup}s${placement:+ ($placement)}"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,memory.used,utilization.gpu \
    --format=csv >>"$LOG" 2>&1
  # One bench serve per rate (ascending), each with its own deadline and JSON, so a rate cut
  # short by the budget loses only itself. Seeds differ per rate (no prefix-cache repeats) and
  # are the same in every configuration; the first rate also sends the warm-ups.
  local i=0 rate warm=$NUM_WARMUPS failures=""
  for rate in ${RATES//,/ }; do
    left=$((BUDGET_S - $(elapsed) - 30))
    if [ "$left" -lt 20 ]; then failures+=" rate $rate skipped (budget);"; continue; fi
    bench_limit=$((left < 120 + DURATION_S ? left : 120 + DURATION_S))
    log "$name: rate $rate req/s (limit ${bench_limit}s)"
    timeout -k 10 "$bench_limit" "$PY" -m pdserve bench serve --base-url "http://127.0.0.1:$port" \
      --tokenizer "$MODEL" --dataset-name random --input-len "$INPUT_LEN" \
      --output-len "$OUTPUT_LEN" --request-rate "$rate" --burstiness 1 \
      --num-prompts "$NUM_PROMPTS" --duration "$DURATION_S" --num-warmups "$warm" \
      --goodput "tpot:$TPOT_SLO_MS" --request-timings --request-timeout "$REQUEST_TIMEOUT" \
      --seed $((SEED + i)) --save-requests --no-progress \
      --result-json "$dir/bench-$i.json" >"$dir/bench-$i.out" 2>&1
    local rc=$?
    tail -n 3 "$dir/bench-$i.out" | tee -a "$LOG"
    [ "$rc" = 0 ] || failures+=" rate $rate: bench serve exit $rc$([ "$rc" = 124 ] && echo " (time limit)");"
    i=$((i + 1)) warm=0
  done
  local verdict="partly failed:$failures"
  [ -z "$failures" ] && verdict="ok:"
  ls "$dir"/bench-*.json >/dev/null 2>&1 || verdict="failed, no rate completed:$failures"
  echo "$verdict ready after ${startup}s, bench $(($(date +%s) - t0 - startup))s${placement:+; $placement}" >"$dir/status"
  stop_up
  stop_redis
  rm -rf "$KV_DIR"
  log "$name: $(cat "$dir/status")"
}

for name in $CONFIGS; do run_config "$name"; done

# --- report -------------------------------------------------------------------------------
SLO="TPOT ≤ ${TPOT_SLO_MS} ms"
"$PY" -m benchmarks.gpu.pd_two_gpu_report report --work "$WORK" --model "$MODEL" \
  --input-len "$INPUT_LEN" --kv-dtype-bytes "$KV_DTYPE_BYTES" --tpot-grid "${TPOT_GRID:-15,25,50,100}" \
  --md "$OUT/pd_two_gpu.md" --json "$JSON" \
  --meta "title=Two GPUs: 1 prefill + 1 decode vs 2 colocated replicas ($MODE run)" \
  --meta "date=$(date -u +%Y-%m-%dT%H:%MZ)" \
  --meta "command=bash benchmarks/gpu/pd_two_gpu.sh${1:+ $1} (RATES=$RATES NUM_PROMPTS=$NUM_PROMPTS DURATION_S=$DURATION_S)" \
  --meta "devices=$GPU_NAMES; torch $TORCH_VERSION" \
  --meta "model=$( [ "$MODE" = cpu ] && echo 'tiny 2-layer body with the Llama-3.1-8B vocabulary, float32' || echo 'Llama-3.1-8B architecture, dummy bf16 weights')" \
  --meta "engines=${ENGINE[*]} --max-model-len $MAX_MODEL_LEN$([ "$MODE" = gpu ] && echo ' (pdserve up --gpus 2 pins each engine to one GPU: P/D runs prefill-0 on GPU 0 and decode-0 on GPU 1, colocated decode-0 on GPU 0 and decode-1 on GPU 1; see each status line)')" \
  --meta "workload=random token prompts of $INPUT_LEN tokens, $OUTPUT_LEN output tokens (ignore_eos), Poisson arrivals at $RATES req/s (one bench serve per rate), up to $NUM_PROMPTS requests or ${DURATION_S}s of sending per rate, $NUM_WARMUPS warm-ups before the first rate, seeds $SEED + rate index (the same prompts for every configuration, none repeated across rates), request timeout ${REQUEST_TIMEOUT}s" \
  --meta "slo=$SLO" \
  --meta "fs store=$KV_WHERE, capacity ${FS_CAP_MB} MiB; redis store=redis-server on loopback, maxmemory ${REDIS_MAXMEMORY:-24gb}, allkeys-lru" \
  >>"$LOG" 2>&1
REPORT_RC=$?
log "total $(elapsed)s; report exit $REPORT_RC"
cp "$LOG" "$OUT/pd_two_gpu_run.log"
tar -C "$WORK" -czf "$OUT/pd_two_gpu_logs.tar.gz" --exclude=model --exclude=site . 2>/dev/null
ls -la "$OUT"
[ -f "$OUT/pd_two_gpu.md" ] && cat "$OUT/pd_two_gpu.md"
exit "$REPORT_RC"
