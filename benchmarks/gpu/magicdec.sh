#!/usr/bin/env bash
# One H200: MagicDec on SmolLM2-135M-Instruct with long documents (every batch 1, 8, 32, 64, 128
# x prefix 2K, 4K, 7K x both drafts: ~2-3 min of compiles, all done before anything is timed,
# then ~2-3 min of measuring; <= 8.5 min), then the Llama-3.1-8B-shape cost-model analysis
# (<= 4 min). JAXSPEC_DEFAULT_GGUF must name the SmolLM2 GGUF. Each part writes its JSON after
# every row, so a timeout leaves partial results. One call's 10-minute limit holds one part:
# "$0" smol, then "$0" 8b.
set -u
source benchmarks/gpu/env.sh
if [ -z "${JAXSPEC_DEFAULT_GGUF:-}" ] && [ -f ~/smol.gguf ]; then
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf  # joined by final2.sh / call2.sh on this machine
fi
part="${1:-all}"
if [ "$part" = all ] || [ "$part" = smol ]; then
  timeout 510 python3 benchmarks/bench_magicdec.py --budget-s 420 --out "$OUT/magicdec.json" \
    2>&1 | grep -v "^\[transformers\]\|donated buffers\|^\s*$" | tee "$OUT/magicdec.log" | tail -60
fi
if [ "$part" = all ] || [ "$part" = 8b ]; then
  timeout 240 python3 benchmarks/bench_magicdec_8b.py --budget-s 170 \
    --out "$OUT/magicdec_8b.json" 2>&1 | tee "$OUT/magicdec_8b.log" | tail -45
fi
