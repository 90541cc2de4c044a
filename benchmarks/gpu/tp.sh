#!/usr/bin/env bash
# pending: no kept result yet (its GPUs have not been lent); tests/test_results_page.py lets a
# pending runner go without a note until its first result lands in benchmarks/results/.
# Tensor parallelism that pays (issue 26) on 2, 4 or 8 H200s (nvidia-h200-x2 / -x4 / -x8), random
# bf16 weights, no GGUF: (1) the Mosaic GPU one-shot all-reduce against its jax.lax reference
# (tests/test_all_reduce.py on the GPUs: bit-equal, back to back); (2) one all-reduce of
# decode-sized messages, NCCL (psum) beside the one-shot kernel and its collective-permute form
# (bench_all_reduce.py; goal: at most 8 us); (3) the Llama-3-8B-shape batch-1 4K decode step on
# one GPU and tensor-parallel over 2 (and 4) in each form: GSPMD, the explicit shard_map step with
# psum, with the one-shot kernel (bench_decode_gpu.py; goals: TP=2 at most 0.62x the one-GPU
# step, TP=4 at most 0.40x; its JSON's top level holds ms_per_token_tp2 / _tp4).
# About 6-9 minutes. Writes $OUT/all_reduce_test.log, $OUT/all_reduce.json, $OUT/gpu_decode_tp.json.
#   bash benchmarks/gpu/tp.sh decode      # only (3)
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
n=$(gpus)
if [ "$n" -lt 2 ]; then echo "tp.sh needs 2 or more GPUs (this machine has $n)" >&2; exit 1; fi
counts=2
[ "$n" -ge 4 ] && counts+=,4
[ "$n" -ge 8 ] && counts+=,8
if [ "${1:-}" != decode ]; then
  bench all_reduce_test 150 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider \
    -m "gpu or not slow" tests/test_all_reduce.py
  bench all_reduce 150 python3 benchmarks/bench_all_reduce.py --devices "$counts" \
    --out "$OUT/all_reduce.json"
fi
cases=8b:1:4096:1
for form in gspmd shard_map oneshot; do cases+=,8b:1:4096:1:2:$form; done
if [ "$n" -ge 4 ]; then for form in shard_map oneshot; do cases+=,8b:1:4096:1:4:$form; done; fi
bench gpu_decode_tp 360 python3 benchmarks/bench_decode_gpu.py --label tp --cases "$cases" \
  --budget-s 300 --out "$OUT/gpu_decode_tp.json"
