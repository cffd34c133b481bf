#!/usr/bin/env bash
# GLM-5.2 on one 8x B200 node (the self-hosted NVIDIA pool; the simulator's b200-glm52 profile): two SGLang servers,
# one per TP4 group, on :31000 and :31001. FP8 checkpoint; NVFP4 works the same way.
set -euo pipefail
export MODEL=${MODEL:-zai-org/GLM-5.2-FP8} BASE_PORT=${BASE_PORT:-31000} DEVICES_VAR=CUDA_VISIBLE_DEVICES
exec "$(dirname "$0")/serve-tp4-groups.sh"
