#!/usr/bin/env bash
# `jaxspec bench` on one H200 with the real SmolLM2-135M-Instruct and the shipped draft, the first
# HumanEval prompts, 128 new tokens, gamma 4. Needs the GGUF (README.md). Under 5 minutes each:
#   bash benchmarks/gpu/bench.sh          # 3 methods, time split: $OUT/bench_h200.json
#   bash benchmarks/gpu/bench.sh peers    # 2 methods + HF peers: $OUT/bench_h200_peers.json
# (results/bench_h200.json, results/bench_h200_peers.json). The JSON is written after every
# method, so a timeout keeps what finished.
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
use_gguf || exit 1
case "${1:-split}" in
split) name=bench_h200 args=(--methods autoregressive,chain,tree --prompts 8 --time-split
  --budget-s 235) ;;
peers) name=bench_h200_peers args=(--methods autoregressive,chain --prompts 4 --no-time-split
  --budget-s 140) ;;
*) echo "usage: $0 [split|peers]" >&2; exit 2 ;;
esac
bench "$name" 300 python3 -m jaxspec.cli bench "${args[@]}" --draft "$DRAFT" \
  --dataset humaneval --max-new-tokens 128 --option gamma=4 --peers hf,hf-assisted \
  --out "$OUT/$name.json"
