#!/usr/bin/env bash
# GLM-5.2 MXFP4 on one 8x MI355X node as TWO SGLang servers, one per TP4 group (GPUs 0-3 on :30000, 4-7 on :30001),
# each with its own scheduler, KV cache, /metrics and /v1/loads, so the gateway sees and routes to each group
# separately (prefix affinity and load are per replica). Not `--tp 4 --dp 2`: that hides two KV caches behind one
# port. Settings are the ones the simulator's MI355X profile is fitted to (docs/simulator.md).
#   IMAGE: lmsysorg/sglang-rocm (a mi35x build of 0.5.12 or newer); run inside it with /dev/kfd and /dev/dri.
set -euo pipefail
MODEL=${MODEL:-amd/GLM-5.2-MXFP4}          # Quark MXFP4 checkpoint (quantization read from its config)
SERVED=${SERVED:-zai-org/GLM-5.2}          # what the gateway's pool `model:` says
BASE_PORT=${BASE_PORT:-30000}
export SGLANG_ENABLE_SPEC_V2=1             # overlap scheduling for EAGLE/MTP

for g in 0 1; do
  HIP_VISIBLE_DEVICES=$((4 * g)),$((4 * g + 1)),$((4 * g + 2)),$((4 * g + 3)) \
  python3 -m sglang.launch_server \
    --model-path "$MODEL" --served-model-name "$SERVED" --trust-remote-code \
    --host 0.0.0.0 --port $((BASE_PORT + g)) \
    --tp 4 \
    --kv-cache-dtype fp8_e4m3 \
    --enable-aiter-allreduce-fusion \
    --speculative-algorithm EAGLE --speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6 \
    --chunked-prefill-size 16384 --max-running-requests 48 \
    --mem-fraction-static 0.85 \
    --tool-call-parser glm47 --reasoning-parser glm45 \
    --enable-cache-report \
    --enable-metrics \
    --enable-priority-scheduling \
    > "sglang-tp4-$g.log" 2>&1 &
done
wait
