#!/usr/bin/env bash
# Bit-exact bf16 (bench_bit_exact.py), one H200: partings from autoregressive decoding and the
# invariant numerics' cost. One model a call: `bit_exact.sh smollm2` (the real SmolLM2, its GGUF:
# README.md) or `bit_exact.sh 1b` (a random Llama-3.2-1B shape). A first process writes its
# autoregressive tokens (--ar-only); then four processes at once split the methods and drafts
# between them (compiles dominate, and each process compiles on its own cores), each comparing
# with its own autoregressive tokens and with the first process's; with `plain` as the second
# argument a fifth one repeats the tree rows with the draft's GPU kernels off. Batch 16 first,
# then batch 1 (each prompt alone). The processes share the GPU, so tokens/s are of a busy GPU.
# About 8 minutes. Writes $OUT/bit_exact_<model>.json (results/bit_exact.json: rows per model).
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
model=${1:-smollm2}
plain=${2:-}
args=(--model "$model" --batches 16,1 --b1-prompts 2 --refs "$OUT/refs_$model.json")
if [ "$model" = smollm2 ]; then
  use_gguf || exit 1
  args+=(--draft "$DRAFT")
fi
bench bit_exact_$model 200 python3 benchmarks/bench_bit_exact.py "${args[@]}" --ar-only
groups=(chain:ngram,chain:model,chain:feature tree:model,tree:ngram,tree:feature
  magicdec:self-streaming,magicdec:model magicdec:feature,magicdec:self-snapkv)
for i in "${!groups[@]}"; do
  bench bit_exact_${model}_$i 340 python3 benchmarks/bench_bit_exact.py "${args[@]}" \
    --runs "${groups[$i]}" --out "$OUT/bit_exact_${model}_$i.json" &
done
if [ "$plain" = plain ]; then
  bench bit_exact_${model}_plain 340 python3 benchmarks/bench_bit_exact.py "${args[@]}" \
    --runs tree:model,tree:feature --plain-draft --out "$OUT/bit_exact_${model}_plain.json" &
fi
wait
python3 benchmarks/bench_bit_exact.py --merge "$OUT"/bit_exact_"${model}"_[0-9].json \
  --out "$OUT/bit_exact_$model.json"
