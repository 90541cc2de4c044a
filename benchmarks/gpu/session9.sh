#!/usr/bin/env bash
# Session 9's GPU calls (issue 10: the prefill). Before the first call of a streak:
#   git rev-parse --short HEAD > .carry1/commit
#
#   call 1 (carry .carry1 .whl): stash the GGUF's first half; the flash prefill kernel's tests
#          compiled on the GPU; prefill time by chunk and attention path at 1K and 4K
#          (probe_prefill.py; the fastest chunk goes to ~/chunk for call 2); the SmolLM2-shape
#          decode step with its kernel sequence, and with shorter/longer attention splits.
#   call 2 (carry .carry2, within 30 s): join the GGUF; bench_small_model at 1K and 4K with
#          JAXSPEC_PREFILL_CHUNK from call 1 (or CHUNK=...).
#
# #   call 3 (carry .carry1 .whl; ran after call 1's machine went idle): stash again; the flash
#          kernel at T = 1024 and 4096 on the GPU (call 1's probe saw another first token at
#          chunk 4096: check_prefill_attention.py), the probe again with logit differences; the
#          decode step with XLA's Triton GEMMs off (cuBLAS). Then call 2 within 30 s.
#
#   call 4 (carry .carry1 .whl): stash again; the SmolLM2-shape step with the padded qkv rows
#          taken by the fused kernel (no slice kernel), then with XLA's exhaustive GEMM tiling
#          search and its fusion autotuner. Then call 5 within 30 s (carry .carry2): call 2
#          again, with XLAX="the flags that won" if any.
#
#   call 6 (no carry): issue 6's 8B and 1B steps with the defaults, with XLA's exhaustive GEMM
#          tiling search, and with it plus the fusion autotuner (call 4's leads: 0.847 -> 0.829
#          -> 0.811 ms on the SmolLM2 shape).
#
#   call 7 (carry .carry1 .whl): stash the GGUF's first half. Then call 8 within 30 s (carry
#          .carry2): bench_small_model at 1024 only, with the defaults (no switch set: the GPU's
#          2048-token prefill chunk is now the default) and the tree shapes 4x8x4 and 8x2x2.
#
#   bash benchmarks/gpu/session9.sh 1|2|3|4|5|6|7|8
set -u
source benchmarks/gpu/env.sh
quiet() { grep -v "^W0000\|^I0000\|^E0000"; }
probe() {  # label, then probe_small arguments; the environment from the caller
  timeout 120 python3 benchmarks/gpu/probe_small.py --label "$@" 2>&1 | quiet | python3 -c "
import json,sys
t=sys.stdin.read(); i=t.find('{')
if i < 0: print(t[-800:]); sys.exit()
r=json.loads(t[i:t.rfind('}')+1])
print(r['label'], r['batch'], r['context'], 'ms', round(r['ms_per_step'],4), 'kernels', r.get('kernels_per_step'), 'busy', r.get('gpu_busy_ms_per_step'))
print('   top', r.get('top'), r.get('trace_error',''))
if '${SEQ:-}': print('   sequence', r.get('sequence'))"
}
stash() {  # the GGUF's first half into the home folder (for a later call), the gguf wheel
  mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target ~/site .whl/*.whl
}
case "${1:?call 1 or 2}" in
1)
  stash
  JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_prefill_attention.py 2>&1 | quiet | tail -4
  timeout 240 python3 benchmarks/gpu/probe_prefill.py --contexts 1024,4096 \
    --chunks 256,1024,4096 --impls reference,auto --out "$OUT/prefill.json" 2>&1 | quiet
  python3 - "$OUT/prefill.json" <<'PY' > ~/chunk
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["attention"] == "auto" and "ms" in r]
best = {}
for r in rows:
    best.setdefault(r["chunk"], {})[r["context"]] = r["ms"]
full = {c: sum(v.values()) for c, v in best.items() if len(v) == 2}
print(min(full, key=full.get) if full else 256)
PY
  echo "chunk for call 2: $(cat ~/chunk)"
  SEQ=1 probe defaults_b1_c1024 --batch 1 --context 1024 --steps 32
  JAXSPEC_ATTN_MIN_SPLIT=128 probe split128_b1_c1024 --batch 1 --context 1024 --steps 32
  JAXSPEC_ATTN_MIN_SPLIT=512 probe split512_b1_c1024 --batch 1 --context 1024 --steps 32
  cp /tmp/probe_*.json "$OUT/" 2>/dev/null; ls "$OUT"
  ;;
3)
  stash
  timeout 120 python3 benchmarks/gpu/check_prefill_attention.py 2>&1 | quiet | tee ~/check
  timeout 200 python3 benchmarks/gpu/probe_prefill.py --contexts 1024,4096 \
    --chunks 1024,2048,4096 --impls reference,auto --out "$OUT/prefill.json" 2>&1 | quiet
  # call 2's chunk: the fastest at 4K (1K fits in any of them) if every check passed, else 1024
  python3 - "$OUT/prefill.json" <<'PY' > ~/chunk
import json, os, sys
check = open(os.path.expanduser("~/check")).read()
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["attention"] == "auto" and "ms" in r]
at4k = {r["chunk"]: r["ms"] for r in rows if r["context"] == 4096}
ok = "FAIL" not in check and check.count("ok") >= 5
print(min(at4k, key=at4k.get) if ok and at4k else 1024)
PY
  echo "chunk for call 2: $(cat ~/chunk)"
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false probe cublas_b1_c1024 --batch 1 --context 1024 \
    --steps 32
  ;;
4)
  stash
  JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_rope_attention.py -k "padded_rows or matches" 2>&1 | quiet | tail -2
  SEQ=1 probe rows_b1_c1024 --batch 1 --context 1024 --steps 32
  EX=--xla_gpu_exhaustive_tiling_search=true
  FA=--xla_gpu_experimental_enable_fusion_autotuner=true
  XLA_FLAGS=$EX SEQ=1 probe exhaustive_b1_c1024 --batch 1 --context 1024 --steps 32
  XLA_FLAGS=$FA probe fusion_autotuner_b1_c1024 --batch 1 --context 1024 --steps 32
  XLA_FLAGS="$EX $FA" probe both_b1_c1024 --batch 1 --context 1024 --steps 32
  cp /tmp/probe_*.json "$OUT/" 2>/dev/null; ls "$OUT"
  ;;
6)
  J="$OUT/decode_rows.json"
  EX=--xla_gpu_exhaustive_tiling_search=true
  FA=--xla_gpu_experimental_enable_fusion_autotuner=true
  for v in "default|" "exhaustive|$EX" "both|$EX $FA"; do
    XLA_FLAGS="${v#*|}" JAXSPEC_LABEL="${v%%|*}" timeout 150 python3 benchmarks/bench_decode_gpu.py \
      --budget-s 60 --cases 8b:1:4096:1,1b:1:4096:1 --out "$J" 2>&1 | quiet | grep -v "^{" | tail -2
  done
  python3 - "$J" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f"{r['label']:>10} {r['case']:>16} " + (f"{r['ms_per_step']:7.3f} ms floor {r['floor_ms']:.3f} {r['floor_over_ms']:.2f} compile {r.get('compile_s')}" if "ms_per_step" in r else r["error"][:150]))
PY
  ;;
7)
  stash
  ;;
8)
  cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
  echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  timeout 450 python3 benchmarks/bench_small_model.py \
    --draft checkpoints/drafts/smollm2-135m-instruct-draft --new 128 --repeats 2 --gammas 8 \
    --contexts 1024 --tree-shapes 4x8x4,8x2x2 --skip-1b --no-hf \
    --out "$OUT/small_model.json" 2>&1 | quiet | grep -v "it/s\]" | tail -16
  ;;
5)
  [ -n "${XLAX:-}" ] && export XLA_FLAGS="$XLAX"
  bash "$0" 2
  ;;
2)
  cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
  echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  export JAXSPEC_PREFILL_CHUNK="${CHUNK:-$(cat ~/chunk 2>/dev/null || echo 256)}"
  timeout 560 python3 benchmarks/bench_small_model.py \
    --draft checkpoints/drafts/smollm2-135m-instruct-draft --new 128 --repeats 3 --gammas 8 \
    --out "$OUT/small_model.json" 2>&1 | quiet | grep -v "it/s\]" | tail -30
  ;;
esac
