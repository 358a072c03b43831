#!/usr/bin/env bash
# The planner's attention share (bench/gpu_attention.py), ep's grouped experts
# (bench/ep_experts.py), then MFU at world 1 on one GPU (H200: at most 9 minutes 45 s in all): a
# ~1B Llama in bf16 with compile, float8, selective activation checkpointing and chunked loss each
# on and off, megatron_fsdp applied at world 1, and the CUDA attention paths; prints markdown
# tables (bench/gpu_attention.py's, bench/gpu_mfu.py's docstring).
#
#     bench/gpu.sh [--rows base,compile,...] [--steps 8] [--peak-tflops 989]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# the planner's attention share, measured: causal SDPA against the block's matmuls, and cp's
# lower-right chunk (does flash attention take it?) (~30 s)
timeout --signal=INT 90 python3 bench/gpu_attention.py || true
# ep's local experts, one grouped GEMM a projection against one linear per expert (~20 s)
timeout --signal=INT 45 python3 bench/ep_experts.py --repeat 10 || true
# the rows share a 420 s budget; the hard stop leaves the table's rows printed so far
exec timeout --signal=INT 450 python3 bench/gpu_mfu.py --budget 420 "$@"
