#!/usr/bin/env bash
# GPU (nvidia-h200-x2): decode/verify step times of the 8B, 1B and SmolLM2 shapes against their
# floors, with XLA flag variants as separate processes (flags are read when jax starts).
# Usage: benchmarks/gpu/decode.sh [budget seconds for the default variant]
set -u
source benchmarks/gpu/env.sh
B=${1:-240}
J="$OUT/decode_rows.json"
run() {  # label, budget, cases, extra XLA flags
  JAXSPEC_LABEL=$1 XLA_FLAGS="${4:-}" timeout $(($2 + 60)) python3 benchmarks/bench_decode_gpu.py \
    --budget-s "$2" --cases "$3" --out "$J" 2>&1 | grep -v "^\s*$" | grep -v "^W0000\|^I0000" | tail -12
}
CB="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
run default "$B" smol:1:1024:1,smol:1:4096:1,1b:1:4096:1,8b:1:4096:1,8b:1:4096:8,8b:1:4096:16,8b:64:4096:1,8b:1:4096:1:2
run cmdbuf 60 smol:1:1024:1,1b:1:4096:1,8b:1:4096:1 "$CB"
run tp2_collective_kernels 45 8b:1:4096:1:2 "--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE"
run tp2_collective_kernels_cmdbuf 45 8b:1:4096:1:2 "--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE $CB,+COLLECTIVES"
python3 - "$J" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f"{r['label']:>30} {r['case']:>18} " + (f"{r['ms_per_step']:8.3f} ms  floor {r['floor_ms']:.3f}  {r['floor_over_ms']:.2f}  fus {r['fusion_ops']} cc {r['custom_calls']}" if "ms_per_step" in r else r["error"][:120]))
PY
