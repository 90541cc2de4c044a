#!/usr/bin/env bash
# Planned for the next GPU session (not run yet). Before the first call:
#   git rev-parse --short HEAD > .carry1/commit
#
#   call 1 (nvidia-h200, carry .carry1 .whl): stash the GGUF's first half, install gguf.
#   call 2 (carry .carry2): join the GGUF; bench_small_model with chain at gamma 4, 6 and 8
#          (issue 10: prompt lookup accepts 2.35 at gamma 6 against 2.12 at 4,
#          results/gamma_sweep_cpu.json; 2x autoregressive needs a 7-token verify <= 1.28 ms).
#   call 3 (nvidia-h200-x2, no carry): the SwiftSpec 8B/1B iteration with a profiler trace of
#          both GPUs (issue 4: which of verify, grow, re-root and handoff sets the iteration).
#
#   bash benchmarks/gpu/session6.sh 1|2|3
set -u
source benchmarks/gpu/env.sh
case "${1:?call 1 to 3}" in
1)
  mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target ~/site .whl/*.whl
  ls -la ~/gguf
  ;;
2)
  cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
  echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  timeout 560 python3 benchmarks/bench_small_model.py \
    --draft checkpoints/drafts/smollm2-135m-instruct-draft --new 128 --repeats 3 --gammas 6,8 \
    --out "$OUT/small_model.json" 2>&1 | grep -v "^W0000\|^I0000" | tail -30
  ;;
3)
  timeout 560 python3 benchmarks/bench_swiftspec_2gpu.py --trace /tmp/sstrace \
    --out "$OUT/swiftspec_2gpu.json" 2>&1 | grep -v "^W0000\|^I0000" | tail -30
  ;;
esac
