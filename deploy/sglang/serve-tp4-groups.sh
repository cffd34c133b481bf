#!/usr/bin/env bash
# Start one SGLang server per TP4 group of an 8-GPU node (GPUs 0-3 on $BASE_PORT, 4-7 on $BASE_PORT+1), with the
# settings every pool here shares; the per-vendor scripts beside this file set MODEL, BASE_PORT, DEVICES_VAR and
# EXTRA_FLAGS (and BOOTSTRAP_BASE for PD prefill servers: group g's bootstrap port is BOOTSTRAP_BASE + g). One server per group (not `--tp 4 --dp 2`, which hides two KV caches behind one port) lets the
# gateway see and route to each group's cache and load separately.
set -euo pipefail
: "${MODEL:?}" "${BASE_PORT:?}" "${DEVICES_VAR:?}"
SERVED=${SERVED:-zai-org/GLM-5.2}          # what the gateway's pool `model:` says
# The gateway sends an explicit priority for every tenant class, so this is belt and braces: without it SGLang gives
# a request that carries no `priority` the LOWEST value. 0.5.13+ only; on 0.5.9 run with DEFAULT_PRIORITY="".
DEFAULT_PRIORITY=${DEFAULT_PRIORITY---default-priority-value 0}
# How each rank orders its queue (docs/routing.md, "Shortest prefill first"):
#   SCHEDULE=priority (default): --enable-priority-scheduling; tenants' priority classes and the gateway's prefill
#     levels order the queue, with its starvation gate.
#   SCHEDULE=shortest-prefill-first (SGLang 0.5.21+): the engine itself orders by uncached tokens and caps a long
#     prefill's chunk so shorter ones share its forward; SGLang refuses it with priority scheduling, so tenants'
#     classes are not honoured on these ranks, and under overload long prompts can starve.
case "${SCHEDULE:-priority}" in
  priority) SCHED_FLAGS="--enable-priority-scheduling $DEFAULT_PRIORITY" ;;
  shortest-prefill-first) SCHED_FLAGS="--schedule-policy shortest-prefill-first" ;;
  *) echo "SCHEDULE must be priority or shortest-prefill-first" >&2; exit 2 ;;
esac
export SGLANG_ENABLE_SPEC_V2=1             # overlap scheduling for EAGLE/MTP

for g in 0 1; do
  env "$DEVICES_VAR=$((4 * g)),$((4 * g + 1)),$((4 * g + 2)),$((4 * g + 3))" \
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
    $SCHED_FLAGS \
    ${EXTRA_FLAGS:-} \
    ${BOOTSTRAP_BASE:+--disaggregation-bootstrap-port $((BOOTSTRAP_BASE + g))} \
    > "sglang-$BASE_PORT-tp4-$g.log" 2>&1 &
done
wait
