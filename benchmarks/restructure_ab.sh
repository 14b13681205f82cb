#!/bin/bash
# A/B of the restructure: the tree before it (25c9259, a git worktree at .wt/old) and this
# tree, alternated round by round with the same flags. Outputs in /tmp/ab_*.
set -u
REPO=$(git rev-parse --show-toplevel)
PY=$REPO/.venv/bin/python
[ -d "$REPO/.wt/old" ] || git -C "$REPO" worktree add --detach "$REPO/.wt/old" 25c9259
for i in 1 2 3; do
  for side in old new; do
    dir=$([ $side = old ] && echo "$REPO/.wt/old" || echo "$REPO")
    (cd "$dir" && PYTHONPATH=$dir $PY benchmarks/engine_cpu.py --skip-hf --num-prompts 16 \
      --output-len 64 --sched-steps 100 --check-prompts 0 --output-json /tmp/ab_engine_${side}_$i.json \
      --output-md /tmp/ab_engine_${side}_$i.md > /tmp/ab_engine_${side}_$i.log 2>&1)
    (cd "$dir" && PYTHONPATH=$dir $PY benchmarks/system_overhead.py --requests 20 --warmup 2 \
      --concurrency 1 4 --sweep-min 8 --sweep-requests-per-stream 2 \
      --output-json /tmp/ab_sys_${side}_$i.json --output-md /tmp/ab_sys_${side}_$i.md \
      > /tmp/ab_sys_${side}_$i.log 2>&1)
    echo "$side $i done $(date +%T)"
  done
done
