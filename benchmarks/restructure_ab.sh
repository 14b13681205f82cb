#!/bin/bash
# A/B: the pre-restructure tree (25c9259) and HEAD, alternated, same flags.
set -u
cd /work/main
for i in 1 2 3; do  # rounds: old, new alternate
  for side in old new; do
    dir=$([ $side = old ] && echo /work/main/.wt/old || echo /work/main)
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python benchmarks/engine_cpu.py --skip-hf --num-prompts 16 --output-len 64 --sched-steps 100 --check-prompts 0 --output-json /tmp/ab_engine_${side}_$i.json --output-md /tmp/ab_engine_${side}_$i.md > /tmp/ab_engine_${side}_$i.log 2>&1)
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python benchmarks/system_overhead.py --requests 20 --warmup 2 --concurrency 1 4 --sweep-min 8 --sweep-requests-per-stream 2 --output-json /tmp/ab_sys_${side}_$i.json --output-md /tmp/ab_sys_${side}_$i.md > /tmp/ab_sys_${side}_$i.log 2>&1)
    echo "$side $i done $(date +%T)"
  done
done
