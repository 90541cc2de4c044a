#!/usr/bin/env bash
# Prefill by chunk and first-chunk path (probe_prefill.py), one GPU, two calls:
#   bash benchmarks/gpu/lib.sh stash && bash benchmarks/gpu/prefill.sh   # call 1, ~2 min:
#     SmolLM2 shape, random bf16 weights, 4K and 8K prompts, the flash kernel against cuDNN for
#     the first chunk, kernel time by kind: $OUT/prefill_probe.json (results/prefill_probe.json)
#   bash benchmarks/gpu/prefill.sh first                                  # call 2, ~1 min:
#     the real SmolLM2's first token after 1K and 4K prompts through generate, each path
#     (needs the GGUF: README.md): $OUT/first_token.json (results/prefill_probe.json's
#     "first_token" section)
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
if [ "${1:-}" = first ]; then
  use_gguf || exit 1
  bench first_token 200 python3 benchmarks/probe_prefill.py --first-token --contexts 1024,4096 \
    --modes off,cudnn --out "$OUT/first_token.json"
  exit
fi
bench prefill_probe 300 python3 benchmarks/probe_prefill.py --contexts 4096,8192 \
  --chunks 2048,4096,8192 --modes off,cudnn --cupti --out "$OUT/prefill_probe.json"
