#!/usr/bin/env bash
# SwiftSpec on two H200s (nvidia-h200-x2; bench_swiftspec_2gpu.py): a Llama-3-8B-shape target on
# GPU 0, a Llama-3.2-1B-shape draft on GPU 1, random bf16 weights; the on-device and threaded
# loops against the serial tree engine, and the bound max(t_verify, d x t_draft + handoff).
# No GGUF needed. About 5-8 minutes. Writes $OUT/swiftspec_2gpu.json (results/swiftspec_2gpu.json).
#   bash benchmarks/gpu/swiftspec.sh --loops-only 3     # only the three loops, at d = 3
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
bench swiftspec_2gpu 480 python3 benchmarks/bench_swiftspec_2gpu.py \
  --out "$OUT/swiftspec_2gpu.json" "$@"
