#!/usr/bin/env bash
# The other common layout: ONE SGLang server per 8-GPU node with `--tp 4 --dp 2` (two TP4 data-parallel ranks behind
# one port), optionally with DP attention (DP_ATTENTION=1, for the MoE's attention). Each rank keeps its own radix
# cache; list the server ONCE in the gateway config: the gateway reads dp_size (or attn_dp_size on 0.5.23 with DP
# attention) from /server_info and routes to each rank as its own target, pinning it with `routed_dp_rank`
# (`data_parallel_rank` on 0.5.9). serve-tp4-groups.sh (one server per TP4 group) needs no pinning at all.
# MODEL, PORT and DEVICES_VAR as in the per-vendor scripts, e.g.
#   MODEL=amd/GLM-5.2-MXFP4 PORT=30000 DEVICES_VAR=HIP_VISIBLE_DEVICES EXTRA_FLAGS=--enable-aiter-allreduce-fusion ./serve-dp.sh
set -euo pipefail
: "${MODEL:?}" "${PORT:?}" "${DEVICES_VAR:?}"
SERVED=${SERVED:-zai-org/GLM-5.2}
DEFAULT_PRIORITY=${DEFAULT_PRIORITY---default-priority-value 0}   # 0.5.13+; DEFAULT_PRIORITY="" on 0.5.9
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
export SGLANG_ENABLE_SPEC_V2=1
DP_FLAGS="--dp 2" MAX_RUNNING=48          # per rank with plain DP
# with DP attention SGLang divides --max-running-requests by the attention-DP size: 96 = 48 per rank
[ "${DP_ATTENTION:-0}" = 1 ] && DP_FLAGS="$DP_FLAGS --enable-dp-attention" MAX_RUNNING=96

env "$DEVICES_VAR=0,1,2,3,4,5,6,7" \
python3 -m sglang.launch_server \
  --model-path "$MODEL" --served-model-name "$SERVED" --trust-remote-code \
  --host 0.0.0.0 --port "$PORT" \
  --tp 4 $DP_FLAGS \
  --kv-cache-dtype fp8_e4m3 \
  --speculative-algorithm EAGLE --speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6 \
  --chunked-prefill-size 16384 --max-running-requests $MAX_RUNNING \
  --mem-fraction-static 0.85 \
  --tool-call-parser glm47 --reasoning-parser glm45 \
  --enable-cache-report \
  --enable-metrics \
  $SCHED_FLAGS \
  ${EXTRA_FLAGS:-}
