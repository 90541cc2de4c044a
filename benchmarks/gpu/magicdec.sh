#!/usr/bin/env bash
# MagicDec on the real SmolLM2-135M-Instruct, one H200 (bench_magicdec.py): batches 1-128 x
# 2K / 4K / 7K-token documents, the self-draft and the shipped draft over a 512-token StreamingLLM
# cache, gamma 2-4, fixed-length and throughput speedups. Needs the GGUF (README.md). Compiles run
# one at a time (the engines' compile cache), once per batch: past --budget-s the rows left are
# listed in not_run. Writes $OUT/magicdec.json (results/magicdec.json) after every row.
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
use_gguf || exit 1
bench magicdec 570 python3 benchmarks/bench_magicdec.py --batches 1,128,64,32,8 \
  --drafts "self-streaming,distilled=$DRAFT" --gammas 2,3,4 --budget-s 400 \
  --out "$OUT/magicdec.json" "$@"
