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
#          the winning setting (or the defaults when none won).
#   call 3 (no carry): issue 6's 8B and 1B steps with and without the kernels.
#
#   bash benchmarks/gpu/session10.sh 1|2|3
set -u
source benchmarks/gpu/env.sh
quiet() { grep -v "^W0000\|^I0000\|^E0000"; }
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
stash() {  # the GGUF's first half into the home folder (for a later call), the gguf wheel
  mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target ~/site .whl/*.whl
}
case "${1:?call 1, 2 or 3}" in
1)
  stash
  JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_fused_linear.py tests/test_rope_attention.py 2>&1 | quiet | tail -4
  A="--batch 1 --context 1024 --steps 32"
  best=$(SEQ=1 probe defaults_b1_c1024 $A)
  echo "JAXSPEC_FUSED_LINEAR=off" > ~/fused
  for v in 64:64:4 128:64:4 64:128:4 32:64:4 64:32:4 64:64:8; do
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
  cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
  echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  set -a; [ -f ~/fused ] && source ~/fused; set +a
  env | grep JAXSPEC_FUSED
  timeout 560 python3 benchmarks/bench_small_model.py \
    --draft checkpoints/drafts/smollm2-135m-instruct-draft --new 128 --repeats 3 --gammas 8 \
    --out "$OUT/small_model.json" 2>&1 | quiet | grep -v "it/s\]" | tail -30
  ;;
3)
  J="$OUT/decode_rows.json"
  for v in "default|off" "fused|auto"; do
    JAXSPEC_FUSED_LINEAR="${v#*|}" JAXSPEC_LABEL="${v%%|*}" timeout 200 python3 \
      benchmarks/bench_decode_gpu.py --budget-s 60 --cases 8b:1:4096:1,1b:1:4096:1 --out "$J" \
      2>&1 | quiet | grep -v "^{" | tail -2
  done
  python3 - "$J" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f"{r['label']:>10} {r['case']:>16} " + (f"{r['ms_per_step']:7.3f} ms floor {r['floor_ms']:.3f} {r['floor_over_ms']:.2f}" if "ms_per_step" in r else r["error"][:150]))
PY
  ;;
esac
