#!/usr/bin/env bash
# Decode and verify steps against their HBM floor (bench_decode_gpu.py), random bf16 weights:
# SmolLM2, Llama-3.2-1B and Llama-3-8B shapes, batch 1 and 64, verify blocks of 8 and 16, tensor
# parallel over two GPUs when the machine has them (nvidia-h200-x2); then the batch-1 steps
# without the 8-row GEMM padding. No GGUF needed. About 5 minutes. `decode.sh attention`: the
# attention kernel's split length on the 8B and 1B shapes (below).
# Writes $OUT/gpu_decode.json (its rows; results/gpu_decode.json also names its headline figures).
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
if [ "${1:-}" = attention ]; then
  # `bash benchmarks/gpu/decode.sh attention` (~2 min): the attention kernel's prefix splits on
  # the Llama shapes' plain path (SmolLM2's fused path bounds its own: notes/attention_split.md),
  # decode_attention.plan's shortest split (JAXSPEC_ATTN_MIN_SPLIT; default 256 slots: 16 splits
  # of 8B's 4K, 128 programs) at 128 and 64 slots, the default first and last (the call's noise).
  # Rows labelled attn_split<N> in $OUT/gpu_decode.json.
  for v in 256 128 64 256; do
    split=()
    [ "$v" = 256 ] || split=(JAXSPEC_ATTN_MIN_SPLIT="$v")
    bench gpu_decode 100 env "${split[@]}" python3 benchmarks/bench_decode_gpu.py \
      --label "attn_split$v" --cases 8b:1:4096:1,1b:1:4096:1 --out "$OUT/gpu_decode.json"
  done
  exit
fi
cases=smol:1:1024:1,smol:1:4096:1,1b:1:4096:1,8b:1:4096:1,8b:1:4096:8,8b:1:4096:16,8b:64:4096:1
[ "$(gpus)" -ge 2 ] && cases+=,8b:1:4096:1:2
bench gpu_decode 360 python3 benchmarks/bench_decode_gpu.py --label default --cases "$cases" \
  --budget-s 240 --out "$OUT/gpu_decode.json"
bench gpu_decode 150 env JAXSPEC_MIN_GEMM_ROWS=1 python3 benchmarks/bench_decode_gpu.py \
  --label rows1 --cases smol:1:1024:1,1b:1:4096:1,8b:1:4096:1 --out "$OUT/gpu_decode.json"
