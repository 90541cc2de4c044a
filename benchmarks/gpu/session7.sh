#!/usr/bin/env bash
# Session 7's GPU calls. Before the first: git rev-parse --short HEAD > .carry1/commit
#
#   1 (nvidia-h200-x2, carry .carry1/commit): the on-device SwiftSpec loop against the threaded
#     loop and the serial tree engine (8B-shape target, 1B-shape draft): 10.38 ms at 422a005,
#     slower than threads; benchmarks/gpu/diag_device_loop.py found why (state copies).
#   2 (nvidia-h200-x2, carry .carry1/commit): after the fix (0cd297f), --loops-only 2 and 3.
#   3 (nvidia-h200-x2, carry .carry1/commit): the full bench_swiftspec_2gpu.py (7c90b6b).
#   4 (nvidia-h200-x2, carry .carry1 .whl): stash the GGUF's first half, install gguf.
#   5 (carry .carry2, within 30 s of 4): join the GGUF; the end-to-end table on the real SmolLM2
#     with HumanEval prompts, SwiftSpec with both loops (issue 4).
#
#   bash benchmarks/gpu/session7.sh 1|2|3|4|5
set -u
source benchmarks/gpu/env.sh
quiet() { grep -v "^\s*$" | grep -v "^W0000\|^I0000\|^W1130\|^\[transformers\]\|donated buffers"; }
case "${1:?call 1 to 5}" in
1)
  timeout 300 python3 benchmarks/bench_swiftspec_2gpu.py --loops-only 2 \
    --out "$OUT/swiftspec_2gpu_loops.json" 2>&1 | quiet | tail -20
  ;;
2)
  timeout 300 python3 benchmarks/bench_swiftspec_2gpu.py --loops-only 2 \
    --out "$OUT/swiftspec_2gpu_loops.json" 2>&1 | quiet | tail -5
  timeout 200 python3 benchmarks/bench_swiftspec_2gpu.py --loops-only 3 \
    --out "$OUT/swiftspec_2gpu_loops_d3.json" 2>&1 | quiet | tail -4
  ;;
3)
  timeout 480 python3 benchmarks/bench_swiftspec_2gpu.py --out "$OUT/swiftspec_2gpu.json" 2>&1 \
    | quiet | tail -22
  ;;
4)
  mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target ~/site .whl/*.whl
  ls -la ~/gguf
  ;;
5)
  cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
  echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  D=checkpoints/drafts/smollm2-135m-instruct-draft
  timeout 420 python3 benchmarks/bench_spec_core.py --set e2e --draft "$D" --prompts 8 \
    --new 128 --out "$OUT/spec_e2e_gpu.json" 2>&1 | tee "$OUT/spec_e2e_gpu.log" | quiet | tail -14
  ;;
esac
