#!/usr/bin/env bash
# Where a SmolLM2-shape decode step's time goes, one H200 (probe_small.py: 32 steps in one device
# loop, its kernels from a profiler trace), random bf16 weights, batch 1: the plain path, each GPU
# default alone and all of them, one process per setting (the switches are read at import).
# No GGUF needed. About 3 minutes. Writes $OUT/probe_<setting>.json, one per setting: the rows of
# results/small_step_probe.json.
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
probe() {  # SETTING CONTEXT [VAR=VALUE...]
  local setting=$1 context=$2
  shift 2
  bench small_step_probe 150 env "$@" python3 benchmarks/probe_small.py --label "$setting" \
    --batch 1 --context "$context" --steps 32 --out "$OUT"
}
plain=(JAXSPEC_FUSED_LINEAR=off JAXSPEC_FUSED_ATTENTION=off JAXSPEC_ROW_PADDING=gemm)
probe plain_c1024 1024 "${plain[@]}"
probe fused_attention_c1024 1024 "${plain[@]}" JAXSPEC_FUSED_ATTENTION=pallas
probe padded_stream_c1024 1024 "${plain[@]}" JAXSPEC_ROW_PADDING=stream
probe fused_attention_padded_stream_c1024 1024 "${plain[@]}" JAXSPEC_FUSED_ATTENTION=pallas \
  JAXSPEC_ROW_PADDING=stream
probe defaults_c1024 1024
probe defaults_c4096 4096
