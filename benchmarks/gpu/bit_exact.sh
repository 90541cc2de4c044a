#!/usr/bin/env bash
# Bit-exact bf16 (bench_bit_exact.py), one H200: partings from autoregressive decoding and the
# invariant numerics' cost. `bit_exact.sh MODEL [RUNS] [BATCHES] [PROCS]`: MODEL smollm2 (the real
# SmolLM2, its GGUF: README.md) or 1b (a random Llama-3.2-1B shape); RUNS the method:draft list
# (bench_bit_exact.py --runs; default every one); BATCHES default 16,1; PROCS processes that share
# the runs (default 1). A first process writes its autoregressive tokens (--ar-only); then PROCS
# processes decode the runs, each comparing with its own autoregressive tokens and with the first
# process's, and their rows are joined into $OUT/bit_exact_<model>.json. One run of the 1B shape
# at batch 16 takes 33-53 s alone (both numerics, compiles included; 9684ca9): with one process a
# call holds about five runs after the --ar-only process (about 40 s). Processes in parallel share
# the GPU, so their tokens/s are each measured beside the others' work (both numerics alike).
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
model=${1:-smollm2}
runs=${2:-}
batches=${3:-16,1}
procs=${4:-1}
parts=~/bit_exact_parts
rm -rf "$parts" && mkdir -p "$parts"
args=(--model "$model" --batches "$batches" --b1-prompts 2 --refs "$parts/refs_$model.json")
if [ "$model" = smollm2 ]; then
  use_gguf || exit 1
  args+=(--draft "$DRAFT")
fi
bench bit_exact_$model 150 python3 benchmarks/bench_bit_exact.py "${args[@]}" --ar-only
[ -n "$runs" ] || runs=$(python3 -c "from benchmarks.bench_bit_exact import RUNS
print(','.join(f'{m}:{d}' for m, d, _ in RUNS))")
IFS=, read -r -a all <<< "$runs"
for ((p = 0; p < procs; p++)); do  # run i goes to process i mod PROCS
  mine=()
  for ((i = p; i < ${#all[@]}; i += procs)); do mine+=("${all[i]}"); done
  [ ${#mine[@]} -gt 0 ] || continue
  mine=$(IFS=,; echo "${mine[*]}")
  bench bit_exact_$model $((560 - SECONDS)) python3 benchmarks/bench_bit_exact.py "${args[@]}" --runs "$mine" \
    --out "$parts/part$p.json" &
done
wait
python3 benchmarks/bench_bit_exact.py --merge "$parts"/part*.json --out "$OUT/bit_exact_$model.json"
