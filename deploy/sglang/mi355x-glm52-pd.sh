#!/usr/bin/env bash
# GLM-5.2 on one 8x MI355X node as two prefill/decode-disaggregated SGLang servers of one ROLE, one per TP4 group
# (:30000 and :30001), with the same settings as mi355x-glm52-tp4.sh. The gateway routes them as a PD pool
# (pd-pool.example.yaml, docs/pd.md); `gateway check` compares what both sides must agree on.
#   ROLE=prefill  computes prompts and sends their KV; bootstrap servers on BOOTSTRAP_BASE (8998) and +1
#   ROLE=decode   receives the KV and generates
# The KV moves over RDMA with TRANSFER_BACKEND (mori, AMD's engine, by default; mooncake and nixl also exist): every
# server of the pool must use the same one. IB_DEVICES names the NICs (e.g. rdma0,rdma1,rdma2,rdma3).
set -euo pipefail
: "${ROLE:?ROLE=prefill or ROLE=decode}"
case "$ROLE" in
  prefill) export BOOTSTRAP_BASE=${BOOTSTRAP_BASE:-8998} ;;
  decode) unset BOOTSTRAP_BASE ;;
  *) echo "ROLE must be prefill or decode" >&2; exit 2 ;;
esac
PD_FLAGS="--disaggregation-mode $ROLE --disaggregation-transfer-backend ${TRANSFER_BACKEND:-mori}"
if [ -n "${IB_DEVICES:-}" ]; then PD_FLAGS="$PD_FLAGS --disaggregation-ib-device $IB_DEVICES"; fi
export EXTRA_FLAGS="$PD_FLAGS ${EXTRA_FLAGS:-}"
exec "$(dirname "$0")/mi355x-glm52-tp4.sh"
