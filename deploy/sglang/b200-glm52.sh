#!/usr/bin/env bash
# GLM-5.2 on one 8x B200 node as two SGLang servers, one per TP4 group (GPUs 0-3 on :31000, 4-7 on :31001) — the
# self-hosted NVIDIA pool (the simulator's b200-glm52 profile). FP8 checkpoint; NVFP4 works the same way.
set -euo pipefail
MODEL=${MODEL:-zai-org/GLM-5.2-FP8}
SERVED=${SERVED:-zai-org/GLM-5.2}
BASE_PORT=${BASE_PORT:-31000}
export SGLANG_ENABLE_SPEC_V2=1

for g in 0 1; do
  CUDA_VISIBLE_DEVICES=$((4 * g)),$((4 * g + 1)),$((4 * g + 2)),$((4 * g + 3)) \
  python3 -m sglang.launch_server \
    --model-path "$MODEL" --served-model-name "$SERVED" --trust-remote-code \
    --host 0.0.0.0 --port $((BASE_PORT + g)) \
    --tp 4 \
    --kv-cache-dtype fp8_e4m3 \
    --speculative-algorithm EAGLE --speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6 \
    --chunked-prefill-size 16384 --max-running-requests 48 \
    --mem-fraction-static 0.85 \
    --tool-call-parser glm47 --reasoning-parser glm45 \
    --enable-cache-report \
    --enable-metrics \
    --enable-priority-scheduling \
    > "sglang-b200-tp4-$g.log" 2>&1 &
done
wait
