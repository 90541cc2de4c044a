#!/usr/bin/env bash
# GPU (nvidia-h200-x2), second round: where the M=1 GEMVs go (kernel census), cuBLAS instead of
# Triton GEMM fusions, TP=2 with the per-device attention kernel and XLA's collective kernels;
# then the SwiftSpec 2-GPU iteration re-measured.
set -u
source benchmarks/gpu/env.sh
J="$OUT/decode_rows2.json"
run() {  # label, budget, cases, XLA flags
  JAXSPEC_LABEL=$1 XLA_FLAGS="${4:-}" timeout $(($2 + 60)) python3 benchmarks/bench_decode_gpu.py \
    --budget-s "$2" --cases "$3" --out "$J" 2>&1 | grep -v "^\s*$" | grep -v "^W0000\|^I0000" | grep -v '^{' | tail -5
}
NT="--xla_gpu_enable_triton_gemm=false"
CK="--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE"
run default 60 smol:1:1024:1,1b:1:4096:1,8b:1:4096:1,8b:1:4096:1:2
run no_triton_gemm 90 smol:1:1024:1,smol:1:4096:1,1b:1:4096:1,8b:1:4096:1,8b:1:4096:16,8b:64:4096:1,8b:1:4096:1:2 "$NT"
run tp2_ck 30 8b:1:4096:1:2 "$CK"
run tp2_ck_no_triton 30 8b:1:4096:1:2 "$CK $NT"
NCCL_PROTO=LL run tp2_nccl_ll 30 8b:1:4096:1:2 "$NT"
python3 - "$J" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    extra = {k: v for k, v in r.items() if k.startswith(("fusion_k", "cc_", "all-", "triton", "cublas"))}
    print(f"{r['label']:>18} {r['case']:>16} " + (f"{r['ms_per_step']:7.3f} ms fl {r['floor_ms']:.3f} {r['floor_over_ms']:.2f} {extra}" if "ms_per_step" in r else r["error"][:150]))
PY
timeout 200 python3 benchmarks/bench_swiftspec_2gpu.py --out "$OUT/swiftspec_2gpu.json" 2>&1 | grep -v "^\s*$" | grep -v "^W0000\|^I0000" | tail -14
