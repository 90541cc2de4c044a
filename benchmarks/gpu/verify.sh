#!/usr/bin/env bash
# What a verification costs against a decode step (bench_verify.py), one H200, random bf16
# weights: SmolLM2 and Llama-3.2-1B shapes at 1K and 4K, the defaults, and the SmolLM2 tree verify
# with the commit kernel off (its A/B). No GGUF. About 4 minutes. Writes $OUT/verify.json.
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
bench verify 150 python3 benchmarks/bench_verify.py --shape smol --context 1024 --out "$OUT/verify.json"
bench verify 150 python3 benchmarks/bench_verify.py --shape smol --context 4096 --out "$OUT/verify.json"
JAXSPEC_FUSED_COMMIT=off bench verify 150 python3 benchmarks/bench_verify.py --shape smol \
  --context 1024 --label commit_off --out "$OUT/verify.json"
bench verify 150 python3 benchmarks/bench_verify.py --shape 1b --context 4096 --out "$OUT/verify.json"
