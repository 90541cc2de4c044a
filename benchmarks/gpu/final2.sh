#!/usr/bin/env bash
# GPU call 2 of the last streak (same machine, within 30 s; carry .carry2): join and check the
# GGUF, then distil the shipped draft and benchmark it (benchmarks/gpu/distill.sh, bounded).
set -u
source benchmarks/gpu/env.sh
cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
DISTILL_BUDGET=${DISTILL_BUDGET:-200} GEN_BUDGET=${GEN_BUDGET:-80} BENCH_BUDGET=${BENCH_BUDGET:-100} \
  bash benchmarks/gpu/distill.sh
