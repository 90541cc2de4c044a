#!/usr/bin/env bash
# Bit-exact bf16 (bench_bit_exact.py), one H200: partings from autoregressive decoding and the
# invariant numerics' cost. One model a call: `bit_exact.sh smollm2` (the real SmolLM2, its GGUF:
# README.md) or `bit_exact.sh 1b` (a random Llama-3.2-1B shape). Each runs twice: a first process
# writes its autoregressive tokens (--ar-only), the second decodes every method and draft and
# compares with its own autoregressive tokens and with the first process's. Batch 16 first, then
# batch 1 (each prompt alone), so a call cut short keeps whole batch-16 rows. About 9 minutes.
# Writes $OUT/bit_exact_<model>.json (merged into results/bit_exact.json: one file, rows per model).
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
model=${1:-smollm2}
shift
args=(--model "$model" --batches 16,1 --b1-prompts 2 --refs "$OUT/refs_$model.json" "$@")
if [ "$model" = smollm2 ]; then
  use_gguf || exit 1
  args+=(--draft "$DRAFT")
fi
bench bit_exact_$model 240 python3 benchmarks/bench_bit_exact.py "${args[@]}" --ar-only
bench bit_exact_$model 330 python3 benchmarks/bench_bit_exact.py "${args[@]}" \
  --out "$OUT/bit_exact_$model.json"
