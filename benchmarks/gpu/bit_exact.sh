#!/usr/bin/env bash
# Bit-exact bf16 (bench_bit_exact.py), one H200: partings from autoregressive decoding and the
# invariant numerics' cost. `bit_exact.sh MODEL [RUNS] [BATCHES]`: MODEL smollm2 (the real
# SmolLM2, its GGUF: README.md) or 1b (a random Llama-3.2-1B shape); RUNS the method:draft list
# (bench_bit_exact.py --runs; default every one); BATCHES default 16,1. A first process writes
# its autoregressive tokens (--ar-only; SmolLM2 at batches 16 and 1 takes over 150 s, most of it
# compiling); the second decodes the runs and compares with its own autoregressive tokens and with
# the first process's. One run of the 1B shape at batch 16 takes 33-53 s (both numerics, compiles
# included; 9684ca9), so a call holds about five runs of one batch after the --ar-only process:
# split the ten over two calls. One process at a time: processes that share the GPU time-slice
# it, and the invariant programs' many small kernels and loop syncs wait for the others' slices.
# Three at once (e1a6bd0, 1B, batch 1) did the --ar-only process and the ten runs in 327 s, but
# the invariant tokens/s fell up to 10x (chain + prompt lookup 25.9 against 256.6 alone at
# deee11b, with 32 new tokens); four at batch 16 on SmolLM2 took 100-250 s a run and finished
# three of the ten in 560 s. Writes $OUT/bit_exact_<model>.json; join the calls' files with
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
