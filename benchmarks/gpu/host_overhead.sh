#!/usr/bin/env bash
# Host time of a warm generate() outside the engine's program (bench_host_overhead.py), one H200:
# random SmolLM2-135M-shape bf16 weights, B=1, 128 tokens, autoregressive / chain / tree. No GGUF.
# About 2 minutes. Writes $OUT/host_overhead.json; results/host_overhead.json holds these rows and
# the CPU run's (`python benchmarks/bench_host_overhead.py --out
# benchmarks/results/host_overhead.json --keep-other-devices` adds one device's rows to the other's).
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
bench host_overhead 200 python3 benchmarks/bench_host_overhead.py --shape smollm2 --reps 20 \
  --out "$OUT/host_overhead.json" "$@"
