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
FILE=small_step_probe.json
probe() {  # SETTING CONTEXT [VAR=VALUE...]
  local setting=$1 context=$2
  shift 2
  bench small_step_probe 150 env "$@" python3 benchmarks/probe_small.py --label "$setting" \
    --batch 1 --context "$context" --steps 32 --out "$OUT" --file "$FILE"
}
if [ "${1:-}" = attention ]; then
  # `bash benchmarks/gpu/small_step.sh attention` (~5 min): the fused attention kernel's prefix
  # split length and KV block (KernelConfig.attention_tile: min_split, block_k) against the
  # fused path's defaults (splits of at least 128 slots, at most 33: fused_linear.COMBINE_BOUNDS;
  # KV blocks of 128 slots of SmolLM2's 64-wide heads) at 1K and 4K of context, batch 1, and at the MagicDec self-draft shape (batch 128, a 512-token cache). Writes
  # $OUT/attention_split.json (results/attention_split.json).
  split() {  # LABEL BATCH CONTEXT STEPS [MIN_SPLIT BLOCK_K [STAGES]]
    local env=()
    [ -n "${5:-}" ] && env=(JAXSPEC_ATTN_MIN_SPLIT="$5" JAXSPEC_ATTN_BLOCK_K="$6")
    [ -n "${7:-}" ] && env+=(JAXSPEC_ATTN_STAGES="$7")
    bench attention_split 150 env "${env[@]}" python3 benchmarks/probe_small.py --label "$1" \
      --batch "$2" --context "$3" --steps "$4" --out "$OUT" --file attention_split.json
  }
  if [ "${2:-}" = launch ]; then
    # `bash benchmarks/gpu/small_step.sh attention launch` (~5 min): the kernel's Triton warps
    # and KV pipeline stages (attention_tile's num_warps, num_stages) at the fused path's own
    # splits, a decode step and a 5-token verify at 1K and the batch-128 self-draft step; the
    # defaults first and last (the call's noise)
    for shape in 1:1:1024:32 1:5:1024:32 128:1:512:16; do
      IFS=: read -r b t c n <<< "$shape"
      for ws in -:- 1:- 2:- 8:- 4:1 4:2 -:-; do
        IFS=: read -r w st <<< "$ws"
        env=()
        [ "$w" != - ] && env+=(JAXSPEC_ATTN_WARPS="$w")
        [ "$st" != - ] && env+=(JAXSPEC_ATTN_STAGES="$st")
        bench attention_split 150 env "${env[@]}" python3 benchmarks/probe_small.py \
          --label "attn_w${w}_s${st}_b${b}_t${t}_c${c}" --batch "$b" --tokens "$t" \
          --context "$c" --steps "$n" --out "$OUT" --file attention_split.json
      done
    done
    exit
  fi
  split defaults_c1024 1 1024 32
  for t in 128:128 64:64 128:64 32:32 512:128; do
    split "attn_split${t%:*}_k${t#*:}_c1024" 1 1024 32 "${t%:*}" "${t#*:}"
  done
  split defaults_c4096 1 4096 32
  for ms in 128 512 1024; do split "attn_split${ms}_k128_c4096" 1 4096 32 "$ms" 128; done
  split defaults_b128_c512 128 512 16
  for ms in 128 512; do split "attn_split${ms}_k128_b128_c512" 128 512 16 "$ms" 128; done
  # the KV pipeline at batch 128 (2 KV blocks a program; 3 stages of 128-slot K and V tiles,
  # 16 KiB each, may take up to 96 KiB of shared memory, which would hold an SM to two
  # programs), where the splits changed nothing
  for t in 256:128:2 256:64:2 256:64:3; do
    IFS=: read -r ms bk st <<< "$t"
    split "attn_split${ms}_k${bk}_s${st}_b128_c512" 128 512 16 "$ms" "$bk" "$st"
  done
  exit
fi
if [ "${1:-}" = rounds ]; then
  # `bash benchmarks/gpu/small_step.sh rounds` (~2 min): where a speculative round's time goes,
  # chains against trees with the same draft, through generate() at batch 1 (probe_rounds.py:
  # random SmolLM2-shape weights and a random 2-layer draft, kernels per round from a profiler
  # trace, and by the source line that traced each kernel; the draft's head cut to 16384 random
  # ids, as the shipped drafts' GPU default). No GGUF. Writes $OUT/spec_rounds.json
  # (results/spec_rounds.json). More options after `rounds` go to the probe (--only ROWS).
  bench spec_rounds 300 python3 benchmarks/probe_rounds.py --random --draft-vocab 16384 \
    --out "$OUT/spec_rounds.json" "${@:2}"
  exit
fi
if [ "${1:-}" = verify ]; then
  # `bash benchmarks/gpu/small_step.sh verify` (~3 min): where a verify block's time goes, the
  # same loop with 1, 5 (a gamma-4 chain) and 16 (the feature draft's tree) tokens a step, at
  # 1K, kernel by kernel: under the defaults (the split-K projection kernels for one-row steps
  # only: KernelConfig.linear_rows 1) and with those kernels for up to 16 rows (linear_rows 16);
  # then 9 tokens with and without the GEMMs' rows padded to 16.
  # Writes $OUT/verify_probe.json (results/verify_probe.json).
  for t in 1 5 16; do
    for rows in 1 16; do
      bench verify_probe 150 env JAXSPEC_LINEAR_ROWS=$rows python3 benchmarks/probe_small.py \
        --label "linear_rows${rows}_t${t}_c1024" --tokens "$t" --context 1024 --steps 32 \
        --out "$OUT" --file verify_probe.json
    done
  done
  # 9 tokens (the default tree's verify, a gamma-8 chain's) as XLA's GEMMs take them, unpadded
  # (KernelConfig.gemm_rows pads only steps of fewer than 8 rows), and padded to 16 rows
  for pad in 8 16; do
    bench verify_probe 150 env JAXSPEC_MIN_GEMM_ROWS=$pad python3 benchmarks/probe_small.py \
      --label "gemm_rows${pad}_t9_c1024" --tokens 9 --context 1024 --steps 32 \
      --out "$OUT" --file verify_probe.json
  done
  exit
fi
if [ "${1:-}" = qkv ]; then
  # `bash benchmarks/gpu/small_step.sh qkv` (~7 min): the Q/K/V projection's own K split
  # (KernelConfig.linear_tile's fourth entry, JAXSPEC_FUSED_QKV_BK): fewer Q/K/V partials for
  # the fused attention kernel to sum in every program, fewer programs in the projection; the
  # common BK first and last (the call's noise). Writes $OUT/qkv_split.json (its rows, with the
  # attention's and the projections' microseconds summed from each row's kernels, are
  # results/qkv_split.json).
  FILE=qkv_split.json
  # the kernels compiled on this GPU first: the projections' and the fused attention kernel's
  # tests (the Q/K/V split's own among them; the one that needs two devices skips itself on
  # one GPU), in the same call as their timing
  bench qkv_split_tests 300 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider \
    -m "not slow" tests/test_fused_linear.py tests/test_rope_attention.py
  for v in 128 256 512 128; do  # 128: the projections' common BK
    probe "qkv_bk${v}_c1024" 1024 JAXSPEC_FUSED_QKV_BK="$v"
  done
  for v in 128 256; do probe "qkv_bk${v}_c4096" 4096 JAXSPEC_FUSED_QKV_BK="$v"; done
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
