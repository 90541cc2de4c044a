#!/usr/bin/env bash
# Distil the shipped draft for SmolLM2-135M-Instruct on one H200, then benchmark it (issue 7).
#
#   benchmarks/gpu/distill.sh          # on the H200: needs JAXSPEC_DEFAULT_GGUF (the real GGUF)
#                                      # and the gguf package (the carried wheel in .whl/)
#   QUICK=1 OUT=/tmp/d PY=.venv/bin/python benchmarks/gpu/distill.sh   # CPU smoke test
#
# Writes to $OUT: distill.log, smollm2-135m-instruct-draft.tar (the draft folder: draft.json +
# params/, ~7 MB), bench_distill.log and distill.json (benchmarks/results/distill.json with an
# "h200" section merged in). Bounded: the conversion of the GGUF (once, ~30 s), the distillation
# (--budget-s $DISTILL_BUDGET: data generation <= $GEN_BUDGET s, then training until the budget;
# the step count is fixed from the measured step time), the benchmark (--budget-s $BENCH_BUDGET).
# Each stage also runs under `timeout` (worst case 120 + 285 + 195 s = 10 min); expected total
# about 7 minutes. The draft tar is written before the benchmark starts.
set -u
source benchmarks/gpu/env.sh
: "${OUT:?set OUT to the output folder}"
PY=${PY:-python3}
RUN=${RUN_DIR:-$HOME/distill-run}
DISTILL_BUDGET=${DISTILL_BUDGET:-240}
GEN_BUDGET=${GEN_BUDGET:-100}
BENCH_BUDGET=${BENCH_BUDGET:-150}
# 368 prompts (HumanEval 21-164 raw and chat-wrapped, MT-Bench), 1 greedy + 12 sampled
# continuations each, 256 new tokens: ~1.8M tokens. 2-layer draft (MLP 512): ~7 MB in bf16.
DISTILL_ARGS=${DISTILL_ARGS:---data humaneval,chat,humaneval@chat --samples 12 --temperature 0.7
  --max-new-tokens 256 --gen-batch 256 --seq-len 512 --batch 32 --steps 4000 --warmup 40
  --lr 1e-3 --layers 2 --intermediate 512 --save-every 200}
BENCH_ARGS=${BENCH_ARGS:-}
if [ "${QUICK:-0}" = 1 ]; then  # a smoke test of the whole script with tiny settings (CPU)
  DISTILL_ARGS="--samples 0 --max-new-tokens 8 --max-prompt-tokens 32 --gen-batch 8
    --seq-len 32 --batch 2 --steps 3 --warmup 2"
  GEN_BUDGET=1 DISTILL_BUDGET=600 BENCH_BUDGET=600 BENCH_ARGS="--prompts 2 --new 8"
  DEVICE_TAG=${DEVICE_TAG:-cpu-quick}
fi
mkdir -p "$OUT"
rm -rf "$RUN"

if ! $PY -c "import gguf" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target ~/site .whl/*.whl
fi
echo "== convert the default model (once)"
timeout 120 $PY -c "from jaxspec.io.default_model import default_checkpoint as d; print(d())" \
  2>&1 | tail -2

echo "== distill (budget ${DISTILL_BUDGET} s, data <= ${GEN_BUDGET} s)"
# shellcheck disable=SC2086
timeout $((DISTILL_BUDGET + 45)) $PY -m jaxspec.cli distill --out "$RUN" $DISTILL_ARGS \
  --budget-s "$DISTILL_BUDGET" --gen-budget-s "$GEN_BUDGET" > "$OUT/distill.log" 2>&1
echo "distill exit $?"
tr '\r' '\n' < "$OUT/distill.log" | grep -v '^\s*$' | awk 'NR % 20 == 0' | tail -8
tail -3 "$OUT/distill.log"
if [ ! -f "$RUN/draft/draft.json" ]; then
  echo "no draft was written"; exit 1
fi
tar -C "$RUN/draft" -cf "$OUT/smollm2-135m-instruct-draft.tar" .
ls -l "$OUT/smollm2-135m-instruct-draft.tar"

echo "== bench_distill (budget ${BENCH_BUDGET} s)"
# shellcheck disable=SC2086
timeout $((BENCH_BUDGET + 45)) $PY benchmarks/bench_distill.py --draft "$RUN/draft" \
  --device-tag "${DEVICE_TAG:-h200}" --budget-s "$BENCH_BUDGET" --out "$OUT/distill.json" \
  $BENCH_ARGS 2>&1 | tee "$OUT/bench_distill.log" | grep -v '^\s*$' | tail -8
