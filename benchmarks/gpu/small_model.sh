#!/usr/bin/env bash
# Small-model latency on one H200 (bench_small_model.py): the real SmolLM2-135M-Instruct at 1K and
# 4K tokens of context, autoregressive, chains and trees with the shipped draft and prompt lookup,
# HF eager, the Llama-3.2-1B-shape step. Needs the GGUF (README.md). About 9 minutes.
# Writes $OUT/small_model.json (results/small_model.json). Extra arguments go to the script:
#   bash benchmarks/gpu/small_model.sh --contexts 1024 --skip-1b --no-hf
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
use_gguf || exit 1
bench small_model 570 python3 benchmarks/bench_small_model.py --draft "$DRAFT" --new 128 \
  --repeats 3 --gammas 8 --out "$OUT/small_model.json" "$@"
