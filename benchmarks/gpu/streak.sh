#!/usr/bin/env bash
# Three back-to-back calls on one warm nvidia-h200-x2 (each under the 10-minute limit; the
# machine stays warm ~30 s between calls). Before the first: git rev-parse --short HEAD >
# .carry1/commit.
#
#   call 1 (carry .carry1 .whl): stash the GGUF's first half, install the gguf wheel; SwiftSpec
#          on two GPUs (8B-shape target, 1B-shape draft, random weights; issue 4); the
#          Llama-3.1-8B-shape MagicDec cost-model analysis (issue 5).
#   call 2 (carry .carry2): join the GGUF and check its sha256; MagicDec on the real SmolLM2 with
#          long documents (issue 5).
#   call 3: the end-to-end table with SwiftSpec on two GPUs (issue 4); jaxspec bench with the
#          time split and HF peers (issue 8).
#
#   bash benchmarks/gpu/streak.sh 1|2|3
set -u
source benchmarks/gpu/env.sh
quiet() { grep -v "^\s*$" | grep -v "^W0000\|^I0000\|^\[transformers\]\|donated buffers"; }
case "${1:?call 1, 2 or 3}" in
1)
  mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/ &
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target ~/site .whl/*.whl
  timeout 280 python3 benchmarks/bench_swiftspec_2gpu.py --out "$OUT/swiftspec_2gpu.json" 2>&1 \
    | tee "$OUT/swiftspec_2gpu.log" | quiet | tail -16
  timeout 230 python3 benchmarks/bench_magicdec_8b.py --budget-s 170 \
    --out "$OUT/magicdec_8b.json" 2>&1 | tee "$OUT/magicdec_8b.log" | quiet | tail -30
  wait
  ls -la ~/gguf
  ;;
2)
  cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
  echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  timeout 510 python3 benchmarks/bench_magicdec.py --budget-s "${MAGICDEC_BUDGET:-420}" \
    --out "$OUT/magicdec.json" 2>&1 | tee "$OUT/magicdec.log" | quiet | tail -50
  ;;
3)
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  D=checkpoints/drafts/smollm2-135m-instruct-draft
  timeout 270 python3 benchmarks/bench_spec_core.py --set e2e --draft "$D" --prompts 8 \
    --new 128 --out "$OUT/spec_e2e_gpu.json" 2>&1 | tee "$OUT/spec_e2e_gpu.log" | quiet | tail -10
  DRAFT="$D" bash benchmarks/gpu/bench.sh
  ;;
esac
