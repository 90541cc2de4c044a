#!/usr/bin/env bash
# GPU call 2 (same machine, within 30 s; carry .carry2): join and check the GGUF, then the real
# SmolLM2-135M-Instruct: autoregressive vs HF eager, and the speculative methods.
set -u
source benchmarks/gpu/env.sh
cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
timeout 200 python3 benchmarks/bench_autoregressive.py --new 128 --repeats 3 \
  --out "$OUT/ar_gpu.json" 2>&1 | tee "$OUT/ar_gpu.log" | grep -v "^\s*$" | tail -12
timeout 240 python3 benchmarks/bench_spec_core.py --prompts 4 --new 128 --swiftspec \
  --out "$OUT/spec_core_gpu.json" 2>&1 | tee "$OUT/spec_core_gpu.log" | grep -v "^\s*$" | tail -14
