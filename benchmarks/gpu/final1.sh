#!/usr/bin/env bash
# GPU (nvidia-h200-x2) call 1 of the last streak (carry .carry1 .whl): stash the GGUF's first half,
# install the gguf wheel; SwiftSpec 2-GPU iteration after the dispatch fix; GEMM row padding.
set -u
source benchmarks/gpu/env.sh
mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/ &
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target ~/site .whl/*.whl
timeout 240 python3 benchmarks/bench_swiftspec_2gpu.py --out "$OUT/swiftspec_2gpu.json" 2>&1 \
  | grep -v "^\s*$" | grep -v "^W0000\|^I0000" | tail -13
J="$OUT/decode_rows3.json"
run() {  # label, budget, cases, XLA flags
  JAXSPEC_LABEL=$1 XLA_FLAGS="${4:-}" timeout $(($2 + 60)) python3 benchmarks/bench_decode_gpu.py \
    --budget-s "$2" --cases "$3" --out "$J" 2>&1 | grep -v "^\s*$" | grep -v "^W0000\|^I0000" | grep -v '^{' | tail -5
}
JAXSPEC_DUMP_HLO="$OUT/hlo" run default 40 smol:1:1024:1,8b:1:4096:1
JAXSPEC_MIN_GEMM_ROWS=8 run pad8 60 smol:1:1024:1,smol:1:4096:1,1b:1:4096:1,8b:1:4096:1,8b:1:4096:1:2
JAXSPEC_MIN_GEMM_ROWS=16 run pad16 30 smol:1:1024:1,8b:1:4096:1
python3 - "$J" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f"{r['label']:>8} {r['case']:>16} " + (f"{r['ms_per_step']:7.3f} ms floor {r['floor_ms']:.3f} {r['floor_over_ms']:.2f}" if "ms_per_step" in r else r["error"][:150]))
PY
timeout 150 python3 benchmarks/bench_hf_shape.py --shape 8b --context 4096 --new 32 --reps 2 --out "$OUT/hf_8b.json" 2>&1 | grep -v "^\s*$" | tail -3
wait; ls -la ~/gguf
