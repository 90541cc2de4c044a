#!/usr/bin/env bash
# The end-to-end table on the real SmolLM2-135M-Instruct (bench_spec_core.py --set e2e): chains,
# trees and SwiftSpec (both loops) with the shipped draft and prompt lookup, the first 8 HumanEval
# prompts. SwiftSpec needs two GPUs (nvidia-h200-x2); the GGUF too (README.md). About 6 minutes.
# Writes $OUT/spec_e2e_gpu.json (results/spec_e2e_gpu.json).
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
use_gguf || exit 1
bench spec_e2e_gpu 420 python3 benchmarks/bench_spec_core.py --set e2e --draft "$DRAFT" \
  --prompts 8 --new 128 --out "$OUT/spec_e2e_gpu.json" "$@"
