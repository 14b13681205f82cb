#!/bin/bash
# A/B of the restructure: the tree before it (25c9259, a git worktree at .wt/old) and this
# tree, alternated round by round with the same flags. Outputs in /tmp/ab_*; the medians
# are in benchmarks/results/system/restructure_ab.json. Run from the repository root:
#   bash benchmarks/system/restructure_ab.sh
set -u
REPO=$(git rev-parse --show-toplevel)
PY=$REPO/.venv/bin/python
[ -d "$REPO/.wt/old" ] || git -C "$REPO" worktree add --detach "$REPO/.wt/old" 25c9259
for i in 1 2 3; do
  for side in old new; do
    if [ $side = old ]; then  # 25c9259 kept its benchmarks as scripts in benchmarks/
      dir=$REPO/.wt/old engine=(benchmarks/engine_cpu.py) system=(benchmarks/system_overhead.py)
    else
      dir=$REPO engine=(-m benchmarks.engine.engine_cpu) system=(-m benchmarks.system.system_overhead)
    fi
    (cd "$dir" && PYTHONPATH=$dir $PY "${engine[@]}" --skip-hf --num-prompts 16 \
      --output-len 64 --sched-steps 100 --check-prompts 0 --output-json /tmp/ab_engine_${side}_$i.json \
      --output-md /tmp/ab_engine_${side}_$i.md > /tmp/ab_engine_${side}_$i.log 2>&1)
    (cd "$dir" && PYTHONPATH=$dir $PY "${system[@]}" --requests 20 --warmup 2 \
      --concurrency 1 4 --sweep-min 8 --sweep-requests-per-stream 2 \
      --output-json /tmp/ab_sys_${side}_$i.json --output-md /tmp/ab_sys_${side}_$i.md \
      > /tmp/ab_sys_${side}_$i.log 2>&1)
    echo "$side $i done $(date +%T)"
  done
done
