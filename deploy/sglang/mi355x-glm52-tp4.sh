#!/usr/bin/env bash
# GLM-5.2 MXFP4 (Quark; quantization read from the checkpoint) on one 8x MI355X node: two SGLang servers, one per
# TP4 group, on :30000 and :30001. fp8 KV cache, aiter all-reduce fusion, EAGLE MTP 5/1/6, 16k prefill chunks, 48
# running requests: the settings the simulator's MI355X profile is fitted to (docs/simulator.md).
# Image: lmsysorg/sglang-rocm (a mi35x build of 0.5.12 or newer), with /dev/kfd and /dev/dri.
set -euo pipefail
export MODEL=${MODEL:-amd/GLM-5.2-MXFP4} BASE_PORT=${BASE_PORT:-30000} DEVICES_VAR=HIP_VISIBLE_DEVICES
export EXTRA_FLAGS="--enable-aiter-allreduce-fusion ${EXTRA_FLAGS:-}"
exec "$(dirname "$0")/serve-tp4-groups.sh"
