#!/usr/bin/env bash
# HF transformers' generate on the Llama-3-8B shape, one H200 (bench_hf_shape.py): random bf16
# weights made on the GPU, a 4064-token prompt, 32 new tokens, dynamic and static cache: the peer
# of gpu_decode's 8B step. No GGUF needed. About 2 minutes.
# Writes $OUT/hf_8b.json (results/hf_8b.json).
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
bench hf_8b 200 python3 benchmarks/bench_hf_shape.py --shape 8b --context 4096 --new 32 --reps 2 \
  --out "$OUT/hf_8b.json"
