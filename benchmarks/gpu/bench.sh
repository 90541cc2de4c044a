#!/usr/bin/env bash
# jaxspec bench with HF peers in the same run on one H200: SmolLM2-135M-Instruct (the GGUF named by
# JAXSPEC_DEFAULT_GGUF, converted once, run in bf16), the first 8 HumanEval prompts, 128 new
# tokens, autoregressive / chain / tree with DRAFT (default ngram), then HF generate plain and
# assisted (prompt lookup for ngram; the draft as assistant model for a draft checkpoint).
# Each jaxspec method row records its time split (draft / verify / handoff / prefill / host: the
# engine's pieces timed at each batch's shapes x the run's counts; --time-split is the CLI's
# default, said explicitly here); that measurement compiles a few pieces per prompt width, so
# allow about a minute more than the bare run.
# Writes $OUT/bench_h200.json after every method (a timeout keeps what finished) and the log.
# About 3-4 minutes; --budget-s stops starting new runs at 235 s.
#   JAXSPEC_DEFAULT_GGUF=~/smol.gguf bash benchmarks/gpu/bench.sh
#   DATASET=chat NAME=bench_h200_chat bash benchmarks/gpu/bench.sh      # MT-Bench prompts
#   PROMPTS=1 NEW=4 ...: a smoke run (CPU)
set -u
source benchmarks/gpu/env.sh
: "${JAXSPEC_DEFAULT_GGUF:?set JAXSPEC_DEFAULT_GGUF to the SmolLM2-135M-Instruct GGUF}"
: "${OUT:?set OUT to the output folder}"
NAME="${NAME:-bench_h200}"
timeout 300 python3 -m jaxspec.cli bench --methods autoregressive,chain,tree \
  --draft "${DRAFT:-ngram}" --dataset "${DATASET:-humaneval}" --prompts "${PROMPTS:-8}" --max-new-tokens "${NEW:-128}" \
  --option gamma=4 --peers hf,hf-assisted --time-split --budget-s 235 --out "$OUT/$NAME.json" \
  2>&1 | tee "$OUT/$NAME.log" | tr '\r' '\n' | grep -v '^\s*$' | tail -15
