#!/usr/bin/env bash
# Two back-to-back calls on one warm nvidia-h200 (the machine stays warm ~30 s between calls).
# Before the first: git rev-parse --short HEAD > .carry1/commit.
#
#   call 1 (carry .carry1 .whl): stash the GGUF's first half, install the gguf wheel; probe a
#          SmolLM2-shape decode step under several XLA options (issue 10).
#   call 2 (carry .carry2): join the GGUF, check its sha256; distil the shipped draft at full
#          budget and benchmark it (issue 7, benchmarks/gpu/distill.sh).
#
#   bash benchmarks/gpu/session4.sh 1|2
set -u
source benchmarks/gpu/env.sh
case "${1:?call 1 or 2}" in
1)
  mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/ &
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target ~/site .whl/*.whl &
  P=benchmarks/gpu/probe_small.py
  DUMP_HLO=1 timeout 90 python3 $P --label default 2>&1 | grep -v "^W0000\|^I0000" | tail -40
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout 80 python3 $P --label cmdbuf_off 2>&1 | tail -30
  XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL" \
    timeout 80 python3 $P --label cmdbuf_while 2>&1 | tail -30
  XLA_FLAGS="--xla_gpu_graph_min_graph_size=1" timeout 80 python3 $P --label graph_min1 2>&1 | tail -30
  JAXSPEC_MIN_GEMM_ROWS=16 timeout 80 python3 $P --label rows16 2>&1 | tail -30
  timeout 80 python3 $P --label ctx4096 --context 4096 2>&1 | tail -30
  wait
  ls -la ~/gguf
  ;;
2)
  cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
  echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  DISTILL_BUDGET=250 GEN_BUDGET=100 BENCH_BUDGET=110 bash benchmarks/gpu/distill.sh
  ;;
esac
