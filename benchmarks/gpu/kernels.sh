#!/usr/bin/env bash
# The Pallas decode / tree attention kernel against the jnp reference and jax's own GQA kernel,
# one H200 (bench_kernels.py): Llama-3-8B heads, batch 1 and 64, 1K-32K tokens, 1, 16 and 64
# queries a row. No GGUF needed. A few minutes.
# Writes $OUT/kernels_h200.json (results/kernels_h200.json).
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
bench kernels_h200 420 python3 benchmarks/bench_kernels.py --out "$OUT/kernels_h200.json" "$@"
