#!/usr/bin/env bash
# Bit-exact bf16 (bench_bit_exact.py), one GPU: partings from autoregressive decoding and the
# invariant numerics' cost. `bit_exact.sh MODEL [RUNS] [BATCHES]`: MODEL smollm2 (the real
# SmolLM2, its GGUF: README.md) or 1b (a random Llama-3.2-1B shape); RUNS the method:draft list
# (bench_bit_exact.py --runs; default every one); BATCHES default 16,1. A first process writes
# its autoregressive tokens (--ar-only); the second decodes the runs and compares with its own
# autoregressive tokens and with the first process's. At 3f166ea (H200) a SmolLM2 run at batch
# 16 took 41-70 s, both numerics, compiles included: one call held the --ar-only process and
# nine runs. Batch-1 prompts share one padded width since cd589af, so a batch-1 run compiles
# once: on an H100 the SmolLM2 --ar-only process and all ten batch-1 runs took 391 s (22-43 s a
# run), three 1B-shape runs with theirs 103 s. A call can be taken back: split the runs over
# calls on one warm machine, and the later ones reuse the first's autoregressive tokens.
# One process at a time: processes that share the GPU time-slice it, and the invariant
# programs' many small kernels wait for the others' slices (three at once, e1a6bd0, cut the
# invariant tokens/s up to 10x). Writes $OUT/bit_exact_<model>.json; join the calls' files with
# `python benchmarks/bench_bit_exact.py --merge A.json B.json --out ...`.
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
model=${1:-smollm2}
runs=${2:-}
batches=${3:-16,1}
# The first process's tokens stay in the home folder, so a later call on the same warm machine
# (the runs split over calls, as a call can be taken back) reuses them.
refs="$HOME/refs_${model}_${batches//,/_}.json"
args=(--model "$model" --batches "$batches" --b1-prompts 2 --refs "$refs")
if [ "$model" = smollm2 ]; then
  use_gguf || exit 1
  args+=(--draft "$DRAFT")
fi
if [ ! -f "$refs" ]; then
  bench bit_exact_$model 300 python3 benchmarks/bench_bit_exact.py "${args[@]}" --ar-only || exit 1
fi
cp "$refs" "$OUT/"
bench bit_exact_$model $((570 - SECONDS)) python3 benchmarks/bench_bit_exact.py "${args[@]}" \
  --runs "$runs" --out "$OUT/bit_exact_$model.json"
