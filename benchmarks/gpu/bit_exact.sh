#!/usr/bin/env bash
# Bit-exact bf16 (bench_bit_exact.py), one H200: partings from autoregressive decoding and the
# invariant numerics' cost, for the real SmolLM2 (GGUF, README.md) and a random Llama-3.2-1B shape.
# About 8 minutes. Writes $OUT/bit_exact.json and $OUT/bit_exact_1b.json (merged into
# results/bit_exact.json: one file, rows per model).
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
use_gguf || exit 1
bench bit_exact 330 python3 benchmarks/bench_bit_exact.py --model smollm2 --draft "$DRAFT" \
  --out "$OUT/bit_exact.json" "$@"
bench bit_exact 240 python3 benchmarks/bench_bit_exact.py --model 1b --prompts 8 --b1-prompts 2 \
  --out "$OUT/bit_exact_1b.json" "$@"
