#!/usr/bin/env bash
# pending: no kept result yet (its GPUs have not been lent); tests/test_results_page.py lets a
# pending runner go without a note until its first result lands in benchmarks/results/.
# SwiftSpec over N GPUs with a tensor-parallel target (issue 26; bench_swiftspec_tp.py): a
# Llama-3-70B-shape target over x GPUs and a Llama-3-8B-shape draft over y (or 1B: --draft 1b),
# random bf16 weights built on their meshes, timed by SwiftSpec's own profile; the predicted
# tokens/s at the acceptance measured on the real small pair, beside SwiftSpec's 348 tok/s (70B,
# 8 Hopper GPUs). The target runs the explicit shard_map step (JAXSPEC_ALL_REDUCE: psum unless
# set, e.g. JAXSPEC_ALL_REDUCE=oneshot). A 70B program compiles for minutes: one split a call.
# No GGUF needed. Writes $OUT/swiftspec_tp.json.
#   bash benchmarks/gpu/swiftspec_tp.sh 4+4            # nvidia-h200-x8 (the default split)
#   bash benchmarks/gpu/swiftspec_tp.sh 4+2 --draft 1b    # x must divide the 8 KV heads: 6+2 cannot
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
split=${1:-4+4}
shift $(($# > 0 ? 1 : 0))
export JAXSPEC_TENSOR_PARALLEL=shard_map JAXSPEC_ALL_REDUCE="${JAXSPEC_ALL_REDUCE:-psum}"
bench swiftspec_tp 570 python3 benchmarks/bench_swiftspec_tp.py --splits "$split" \
  --out "$OUT/swiftspec_tp.json" "$@"
