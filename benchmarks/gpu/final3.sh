#!/usr/bin/env bash
# GPU call 3 of the last streak: the real SmolLM2 with the draft distilled in call 2
# (~/distill-run/draft): small-model latency (issue 10), the end-to-end table with SwiftSpec on
# two GPUs (issue 4), and jaxspec bench with HF peers (issue 8).
set -u
source benchmarks/gpu/env.sh
export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
D=~/distill-run/draft
[ -f "$D/draft.json" ] || D=checkpoints/drafts/smollm2-135m-instruct-draft
echo "draft: $D"
timeout 180 python3 benchmarks/bench_small_model.py --draft "$D" --new 128 --repeats 3 \
  --out "$OUT/small_model.json" 2>&1 | grep -v "^\s*$" | grep -v "^W0000\|^I0000" | tail -16
timeout 150 python3 benchmarks/bench_spec_core.py --set e2e --draft "$D" --prompts 8 --new 128 \
  --out "$OUT/spec_e2e_gpu.json" 2>&1 | grep -v "^\s*$" | grep -v "^W0000\|^I0000" | tail -8
DRAFT="$D" bash benchmarks/gpu/bench.sh
