#!/usr/bin/env bash
# The models round on one GPU (issue 40), in one call of at most ~9 minutes: each step has
# its own deadline, and a step that fails or times out does not stop the next. Results go
# to $OUT (or ./out), named after the GPU kind (h100 / h200):
#   1. the GPU tests of the new architectures (tests/gpu/test_models_gpu.py -k "gpt_oss or
#      deepseek": bf16 agreement with transformers, graphs on and off, and the fused
#      experts with biases) -> models_gpu_tests_<gpu>.log
#   2. the fused MoE tiles, a quick sweep -> moe_layer_<gpu>.json, and the tuned table
#      (engine/models/moe_configs.json, this GPU's keys added) -> moe_configs.json
#   3. the MoE models that fit this GPU: load (layer by layer), decode step vs roofline,
#      a small 1k/1k -> moe_models_<gpu>.json
#   4. 8 LoRA adapters vs the base at batch 64 -> lora_step_<gpu>.json
# Every log is <step>.log in $OUT; summary.txt has one line per step.
#   bash benchmarks/gpu/models_round.sh
# Carry .carry/tokenizer (benchmarks/README.md "GPU runs still to make") for step 1.
set -uo pipefail
# shellcheck source=benchmarks/gpu/round_lib.sh
source benchmarks/gpu/round_lib.sh

step models_gpu_tests_$gpu 90 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 80 \
  -k "gpt_oss or deepseek" tests/gpu/test_models_gpu.py
step moe_layer_$gpu 100 python3 -m benchmarks.gpu.moe_layer --tune --quick --tokens 1,64,1024 \
  --shapes qwen3_30b_a3b,mixtral_8x7b \
  --json "$out/moe_layer_$gpu.json"
cp engine/models/moe_configs.json "$out/moe_configs.json"
step moe_models_$gpu 250 python3 -m benchmarks.gpu.moe_models --prompts 16 --new-tokens 128 \
  --json "$out/moe_models_$gpu.json"
step lora_step_$gpu 90 python3 -m benchmarks.gpu.lora_step --device cuda --steps 16 \
  --out "$out/lora_step_$gpu.json"
