#!/usr/bin/env bash
# Planned for the next GPU session (not run yet). Before the first call:
#   git rev-parse --short HEAD > .carry1/commit
#
#   call 1 (nvidia-h200-x2, carry .carry1): issue 4's open question first, while two GPUs are
#          lent: the on-device SwiftSpec loop (loop="device") against the threaded loop and the
#          serial tree engine at d = 2 (prediction ~6.4 ms, ~0.8x serial; notes/swiftspec_2gpu.md)
#          (the threaded loop's trace is in swiftspec_2gpu.json).
#   call 2 (nvidia-h200, carry .carry1 .whl): stash the GGUF's first half, install gguf.
#   call 3 (carry .carry2): join the GGUF; bench_small_model with the new decode-attention
#          tiling (512e8c0: -6% per step at 1K in the probe), chains at gamma 4, 6 and 8.
#
#   bash benchmarks/gpu/session7.sh 1|2|3
set -u
source benchmarks/gpu/env.sh
case "${1:?call 1 to 3}" in
1)
  timeout 300 python3 benchmarks/bench_swiftspec_2gpu.py --loops-only 2 \
    --out "$OUT/swiftspec_2gpu_loops.json" 2>&1 | grep -v "^W0000\|^I0000" | tail -20
  ;;
2)
  mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target ~/site .whl/*.whl
  ls -la ~/gguf
  ;;
3)
  cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
  echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  timeout 560 python3 benchmarks/bench_small_model.py \
    --draft checkpoints/drafts/smollm2-135m-instruct-draft --new 128 --repeats 3 --gammas 6,8 \
    --out "$OUT/small_model.json" 2>&1 | grep -v "^W0000\|^I0000" | tail -30
  ;;
esac
