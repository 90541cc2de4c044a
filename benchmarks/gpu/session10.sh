#!/usr/bin/env bash
# GPU calls prepared in session 10 (no device time was left to run them): issue 10's split-K
# projection kernels (pallas_kernels/fused_linear.py, JAXSPEC_FUSED_LINEAR=auto), built and
# tested on CPU only. Before the first call of a streak:
#   git rev-parse --short HEAD > .carry1/commit
#
#   call 1 (carry .carry1 .whl): stash the GGUF's first half; the kernels' tests compiled on the
#          GPU (fused_linear, and rope_attention taking Q/K/V partials); the SmolLM2-shape step
#          with the defaults, then with the split-K kernels at several tilings (BN x BK x warps).
#          The fastest tiling goes to ~/fused for call 2, and only if it beat the defaults.
#   call 2 (carry .carry2, within 30 s): join the GGUF; bench_small_model at 1K and 4K with
#          the winning setting (or the defaults when none won) and the one-kernel tree commit
#          (pallas_kernels/kv_commit.py, JAXSPEC_FUSED_COMMIT=auto).
#   call 3 (no carry, within 30 s): the same at 1K with the commit kernel off (its A/B: tree
#          verifies were 0.3 ms slower than chain ones; the plain commit is a gather and a
#          scatter in each of 60 caches).
#   (The 1B and 8B shapes take the plain path: fused_linear.layer_problem.)
#
# Predicted before any run (session 10), to check against: the split-K step is 30 x 5 kernels
# plus ~10, against 341. If a projection kernel takes 2.5-3.5 us (its weights take 0.3-1 us to
# read at 3.5 TB/s; the rest is launch and one or two round trips to memory), the SmolLM2 step
# goes from ~0.83 to 0.55-0.65 ms and autoregressive decoding at 1K past 1400 tok/s. At ~5 us a
# kernel (the L2 re-reads of partials in the norm kernels, or poor Triton code for the GEMV),
# it breaks even. The commit kernel should take a tree verify from ~1.16 ms to ~0.9 ms (one
# kernel of a few us for what is likely ~120 of ~2.4 us).
#
#   bash benchmarks/gpu/session10.sh 1|2|3
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
probe() {  # label, then probe_small arguments; the environment from the caller; prints ms
  timeout 120 python3 benchmarks/gpu/probe_small.py --label "$@" 2>&1 | quiet | python3 -c "
import json,sys
t=sys.stdin.read(); i=t.find('{')
if i < 0: print(t[-800:]); sys.exit()
r=json.loads(t[i:t.rfind('}')+1])
print(r['label'], 'ms', round(r['ms_per_step'],4), 'kernels', r.get('kernels_per_step'), 'busy', r.get('gpu_busy_ms_per_step'), file=sys.stderr)
print('   top', r.get('top'), r.get('trace_error',''), file=sys.stderr)
if '${SEQ:-}': print('   sequence', r.get('sequence'), file=sys.stderr)
print(r['ms_per_step'])"
}
case "${1:?call 1, 2 or 3}" in
1)
  stash
  JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_fused_linear.py tests/test_rope_attention.py 2>&1 | quiet | tail -4
  A="--batch 1 --context 1024 --steps 32"
  best=$(SEQ=1 probe defaults_b1_c1024 $A)
  echo "JAXSPEC_FUSED_LINEAR=off" > ~/fused
  for v in 64:128:4 64:64:4 128:128:4 32:128:4 64:256:4 64:128:8; do
    IFS=: read -r bn bk w <<< "$v"
    ms=$(JAXSPEC_FUSED_LINEAR=auto JAXSPEC_FUSED_BN=$bn JAXSPEC_FUSED_BK=$bk \
      JAXSPEC_FUSED_WARPS=$w SEQ=1 probe "fused_${bn}x${bk}w${w}_b1_c1024" $A)
    if python3 -c "import sys; sys.exit(not (float('$ms') < float('$best')))" 2>/dev/null; then
      best=$ms
      printf 'JAXSPEC_FUSED_LINEAR=auto\nJAXSPEC_FUSED_BN=%s\nJAXSPEC_FUSED_BK=%s\nJAXSPEC_FUSED_WARPS=%s\n' \
        "$bn" "$bk" "$w" > ~/fused
    fi
  done
  echo "setting for call 2 ($best ms):"; cat ~/fused
  cp /tmp/probe_*.json "$OUT/" 2>/dev/null; ls "$OUT"
  ;;
2)
  join_gguf || exit 1
  set -a; [ -f ~/fused ] && source ~/fused; set +a
  export JAXSPEC_FUSED_COMMIT=auto
  env | grep JAXSPEC_FUSED
  timeout 560 python3 benchmarks/bench_small_model.py \
    --draft checkpoints/drafts/smollm2-135m-instruct-draft --new 128 --repeats 3 --gammas 8 \
    --out "$OUT/small_model.json" 2>&1 | quiet | grep -v "it/s\]" | tail -30
  ;;
3)
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  set -a; [ -f ~/fused ] && source ~/fused; set +a
  export JAXSPEC_FUSED_COMMIT=off
  timeout 450 python3 benchmarks/bench_small_model.py \
    --draft checkpoints/drafts/smollm2-135m-instruct-draft --new 128 --repeats 2 --gammas 8 \
    --contexts 1024 --skip-1b --no-hf --out "$OUT/small_model_commit_off.json" 2>&1 | quiet \
    | grep -v "it/s\]" | tail -16
  ;;
esac
