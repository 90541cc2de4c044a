#!/usr/bin/env bash
# Session 8's GPU calls. Before the first call of a streak:
#   git rev-parse --short HEAD > .carry1/commit
#
#   call 1 (ran at bd8565f; carry .carry1 .whl): the first fused-attention kernel against the
#          plain step (SmolLM2 shape, batch 1 at 1K and 4K, batch 128 at 512), unpadded GEMM
#          rows, the 8B and 1B steps with and without it, the single-exchange SwiftSpec loop.
#          Results: benchmarks/notes/small_step_probe.md, swiftspec_2gpu_loops.md.
#   call 2 (carry .carry1 .whl): stash the GGUF's first half; the fused kernel that takes qkv
#          whole, checked against its reference on the GPU; the SmolLM2-shape step with it,
#          with XLA's split-K GEMMs off and with the Triton normalization fusions, each against
#          the plain step; the 8B/1B steps with it (issue 6).
#   call 3 (carry .carry2, within 30 s): join the GGUF; bench_small_model at 1K and 4K with the
#          settings call 2 showed fastest: FUSED=pallas|off, XLAX="extra XLA flags".
#          (Ran at 6e486ea with FUSED=pallas: small_model.json.)
#   call 4 (no carry, within 30 s, two GPUs): the end-to-end table (bench_spec_core --set e2e).
#   call 5 (carry .carry1 .whl): stash the GGUF's first half; the fused kernel with its block
#          part's loads hoisted, checked on the GPU; the SmolLM2-shape step with the residual
#          stream padded once (JAXSPEC_ROW_PADDING=stream) against per-GEMM pads, with and
#          without the fused kernel; the 8B/1B steps with both. Then call 3 again with the
#          fastest (ROWS=stream|gemm, FUSED=pallas|off).
#          (Ran at 3d88e27; then call 3 with FUSED=pallas ROWS=stream.)
#   call 6 (carry .carry1 .whl): stash the GGUF's first half; the SmolLM2-shape step with the
#          defaults (both now on for one GPU). Then call 7 within 30 s (carry .carry2): the
#          small-model bench with the defaults (no switches set), with its first-token and
#          decode-only rates; 2 repeats and no 1B step, for the device time left.
#
#   bash benchmarks/gpu/session8.sh 1|2|3|4|5|6|7
set -u
source benchmarks/gpu/env.sh
probe() {  # label, then probe_small arguments; the environment from the caller
  timeout 120 python3 benchmarks/gpu/probe_small.py --label "$@" 2>&1 \
    | grep -v "^W0000\|^I0000\|^E0000" | python3 -c "
import json,sys
t=sys.stdin.read(); i=t.find('{')
if i < 0: print(t[-800:]); sys.exit()
r=json.loads(t[i:t.rfind('}')+1])
print(r['label'], r['batch'], r['context'], 'ms', round(r['ms_per_step'],4), 'kernels', r.get('kernels_per_step'), 'busy', r.get('gpu_busy_ms_per_step'))
print('   top', r.get('top'), r.get('trace_error',''))"
}
J="$OUT/decode_rows.json"
decode() {  # issue 6's 8B and 1B steps, the environment (JAXSPEC_LABEL, switches) from the caller
  timeout 120 python3 benchmarks/bench_decode_gpu.py --budget-s 60 \
    --cases 8b:1:4096:1,8b:1:4096:16,1b:1:4096:1 --out "$J" 2>&1 | grep -v "^W0000\|^I0000\|^{" | tail -3
}
stash() {  # the GGUF's first half into the home folder (for a later call), the gguf wheel
  mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target ~/site .whl/*.whl
}
decode_table() {
  python3 - "$J" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f"{r['label']:>8} {r['case']:>16} " + (f"{r['ms_per_step']:7.3f} ms floor {r['floor_ms']:.3f} {r['floor_over_ms']:.2f}" if "ms_per_step" in r else r["error"][:150]))
PY
}
case "${1:?call 1 to 7}" in
1)
  stash
  timeout 150 python3 benchmarks/gpu/check_rope_attention.py 2>&1 | grep -v "^W0000\|^I0000"
  probe plain_b1_c1024 --batch 1 --context 1024 --steps 32
  JAXSPEC_FUSED_ATTENTION=pallas probe fused_b1_c1024 --batch 1 --context 1024 --steps 32
  JAXSPEC_MIN_GEMM_ROWS=1 probe rows1_b1_c1024 --batch 1 --context 1024 --steps 32
  JAXSPEC_MIN_GEMM_ROWS=1 JAXSPEC_FUSED_ATTENTION=pallas probe rows1_fused_b1_c1024 \
    --batch 1 --context 1024 --steps 32
  for f in off pallas; do  # issue 6's 8B and 1B steps with and without the fused kernel
    JAXSPEC_LABEL=$f JAXSPEC_FUSED_ATTENTION=$f decode
  done
  decode_table
  if [ "$(python3 -c 'import jax; print(jax.device_count())')" -ge 2 ]; then
    timeout 200 python3 benchmarks/bench_swiftspec_2gpu.py --loops-only 2 \
      --out "$OUT/swiftspec_2gpu_loops.json" 2>&1 | grep -v "^W0000\|^I0000" | tail -5
  fi
  for c in "1 4096" "128 512"; do
    set -- $c
    probe "plain_b$1_c$2" --batch "$1" --context "$2" --steps 32
    JAXSPEC_FUSED_ATTENTION=pallas probe "fused_b$1_c$2" --batch "$1" --context "$2" --steps 32
  done
  cp /tmp/probe_*.json "$OUT/" 2>/dev/null; ls "$OUT"
  ;;
2)
  stash
  timeout 150 python3 benchmarks/gpu/check_rope_attention.py 2>&1 | grep -v "^W0000\|^I0000"
  SK=--xla_gpu_enable_split_k_autotuning=false
  SM=--xla_gpu_experimental_enable_triton_softmax_priority_fusion=true
  probe plain_b1_c1024 --batch 1 --context 1024 --steps 32
  JAXSPEC_FUSED_ATTENTION=pallas probe qkv_b1_c1024 --batch 1 --context 1024 --steps 32
  XLA_FLAGS=$SK JAXSPEC_FUSED_ATTENTION=pallas probe qkv_nosplitk_b1_c1024 --batch 1 --context 1024 --steps 32
  XLA_FLAGS=$SK probe plain_nosplitk_b1_c1024 --batch 1 --context 1024 --steps 32
  XLA_FLAGS=$SM JAXSPEC_FUSED_ATTENTION=pallas probe qkv_softmax_b1_c1024 --batch 1 --context 1024 --steps 32
  XLA_FLAGS="$SK $SM" JAXSPEC_FUSED_ATTENTION=pallas probe qkv_nosplitk_softmax_b1_c1024 --batch 1 --context 1024 --steps 32
  probe plain_b1_c4096 --batch 1 --context 4096 --steps 32
  JAXSPEC_FUSED_ATTENTION=pallas probe qkv_b1_c4096 --batch 1 --context 4096 --steps 32
  for f in off pallas; do  # issue 6's 8B and 1B steps with and without the fused kernel
    JAXSPEC_LABEL=$f JAXSPEC_FUSED_ATTENTION=$f decode
  done
  decode_table
  ls "$OUT"
  ;;
3)
  cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
  echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf JAXSPEC_FUSED_ATTENTION="${FUSED:-off}"
  export JAXSPEC_ROW_PADDING="${ROWS:-gemm}"
  [ -n "${XLAX:-}" ] && export XLA_FLAGS="$XLAX"
  timeout 570 python3 benchmarks/bench_small_model.py \
    --draft checkpoints/drafts/smollm2-135m-instruct-draft --new 128 --repeats 3 --gammas 8 \
    --out "$OUT/small_model.json" 2>&1 | grep -v "^W0000\|^I0000" | tail -30
  ;;
4)
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf JAXSPEC_FUSED_ATTENTION="${FUSED:-off}"
  [ -n "${XLAX:-}" ] && export XLA_FLAGS="$XLAX"
  timeout 420 python3 benchmarks/bench_spec_core.py --set e2e \
    --draft checkpoints/drafts/smollm2-135m-instruct-draft --prompts 8 --new 128 \
    --out "$OUT/spec_e2e_gpu.json" 2>&1 | grep -v "^W0000\|^I0000" | tail -14
  ;;
5)
  stash
  timeout 150 python3 benchmarks/gpu/check_rope_attention.py 2>&1 | grep -v "^W0000\|^I0000"
  probe plain_b1_c1024 --batch 1 --context 1024 --steps 32
  JAXSPEC_FUSED_ATTENTION=pallas probe qkv_b1_c1024 --batch 1 --context 1024 --steps 32
  JAXSPEC_ROW_PADDING=stream probe stream_b1_c1024 --batch 1 --context 1024 --steps 32
  JAXSPEC_ROW_PADDING=stream JAXSPEC_FUSED_ATTENTION=pallas probe qkv_stream_b1_c1024 \
    --batch 1 --context 1024 --steps 32
  JAXSPEC_ROW_PADDING=stream JAXSPEC_FUSED_ATTENTION=pallas probe qkv_stream_b1_c4096 \
    --batch 1 --context 4096 --steps 32
  JAXSPEC_LABEL=qkv_stream JAXSPEC_FUSED_ATTENTION=pallas JAXSPEC_ROW_PADDING=stream decode
  decode_table
  ls "$OUT"
  ;;
6)
  stash
  probe defaults_b1_c1024 --batch 1 --context 1024 --steps 32
  ;;
7)
  cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
  echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  timeout 400 python3 benchmarks/bench_small_model.py \
    --draft checkpoints/drafts/smollm2-135m-instruct-draft --new 128 --repeats 2 --gammas 8 \
    --skip-1b --out "$OUT/small_model.json" 2>&1 | grep -v "^W0000\|^I0000" | grep -v "it/s\]" | tail -24
  ;;
esac
