#!/usr/bin/env bash
# MagicDec's cost model at the Llama-3.1-8B shape, one H200 (bench_magicdec_8b.py): T_T, T_D and
# T_V measured with random bf16 weights at batches 1-128 x prefixes 1K-32K, speedups predicted at
# alpha 0.8. No GGUF needed. About 2-4 minutes.
# Writes $OUT/magicdec_8b.json (results/magicdec_8b.json).
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
bench magicdec_8b 240 python3 benchmarks/bench_magicdec_8b.py --budget-s 170 \
  --out "$OUT/magicdec_8b.json" "$@"
