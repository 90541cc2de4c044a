#!/usr/bin/env bash
# Where a SmolLM2-shape decode step's time goes, one H200 (probe_small.py: 32 steps in one device
# loop, its kernels from a profiler trace), random bf16 weights, batch 1: the plain path, the
# defaults (KernelConfig's GPU row), and the split-K projection kernels at other tilings (which
# tiling is the default is decided here). One process per setting (set through JAXSPEC_*, which
# the script reads with KernelConfig.from_env). No GGUF. About 4 minutes. Writes
# $OUT/small_step_probe.json (a row per setting: results/small_step_probe.json).
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
probe() {  # SETTING CONTEXT [VAR=VALUE...]
  local setting=$1 context=$2
  shift 2
  bench small_step_probe 150 env "$@" python3 benchmarks/probe_small.py --label "$setting" \
    --batch 1 --context "$context" --steps 32 --out "$OUT"
}
if [ "${1:-}" = attention ]; then
  # `bash benchmarks/gpu/small_step.sh attention` (~3 min): the fused attention kernel's prefix
  # split length and KV block (KernelConfig.attention_tile: min_split, block_k), decode_attention
  # .plan's defaults (256, 128 slots of SmolLM2's 64-wide heads) against shorter splits, which
  # give each program fewer sequential KV blocks; then the MagicDec self-draft shape's defaults
  probe defaults_c1024 1024
  for t in 128:128 64:64 128:64 32:32; do
    IFS=: read -r ms bk <<< "$t"
    probe "attn_split${ms}_k${bk}_c1024" 1024 JAXSPEC_ATTN_MIN_SPLIT="$ms" JAXSPEC_ATTN_BLOCK_K="$bk"
  done
  bench small_step_probe 150 python3 benchmarks/probe_small.py --label defaults_b128_c512 \
    --batch 128 --context 512 --steps 16 --out "$OUT"
  exit
fi
plain=(JAXSPEC_FUSED_LINEAR=off JAXSPEC_FUSED_ATTENTION=off JAXSPEC_ROW_PADDING=gemm)
probe plain_c1024 1024 "${plain[@]}"
probe defaults_c1024 1024
for t in 128:128:4 32:128:4 64:256:4 64:64:4 64:128:8; do
  IFS=: read -r bn bk w <<< "$t"
  probe "tile_${bn}x${bk}x${w}_c1024" 1024 JAXSPEC_FUSED_BN="$bn" JAXSPEC_FUSED_BK="$bk" \
    JAXSPEC_FUSED_WARPS="$w"
done
probe defaults_c4096 4096
