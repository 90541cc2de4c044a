#!/usr/bin/env bash
# Prefill time by attention path and chunk, SmolLM2 shape, random bf16 weights, one H200
# (probe_prefill.py): the jnp reference against the flash kernel at 1K and 4K prompt tokens.
# No GGUF needed. About 3 minutes. Writes $OUT/prefill_probe.json (results/prefill_probe.json).
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
bench prefill_probe 300 python3 benchmarks/probe_prefill.py --contexts 1024,4096 \
  --chunks 256,1024,2048,4096 --impls reference,auto --out "$OUT/prefill_probe.json"
