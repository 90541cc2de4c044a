#!/usr/bin/env bash
# The shipped draft of SmolLM2-135M-Instruct, distilled on one H200 (jaxspec distill), and its
# measurement (bench_distill.py: chains with it, prompt lookup and self-streaming on the 20
# held-out HumanEval prompts). Needs the GGUF and the gguf wheel (README.md). Two calls:
#   bash benchmarks/gpu/distill.sh         # ~8 min: $OUT/smollm2-135m-instruct-draft.tar
#   bash benchmarks/gpu/distill.sh bench   # ~3 min: $OUT/distill.json; its "h200" (or "h100")
#                                          # section is results/distill.json's (DRAFT_DIR:
#                                          # another draft)
# The defaults are the shipped draft's run (checkpoints/README.md). DATA_FROM=RUN/data reuses
# an earlier run's data (runs compared on the same text; the data options must match), NAME
# names the tar. A smoke test on a CPU:
#   QUICK=1 OUT=/tmp/d PY=.venv/bin/python bash benchmarks/gpu/distill.sh [bench]
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
PY=${PY:-python3}
RUN=${RUN_DIR:-$HOME/distill-run}
BUDGET=${DISTILL_BUDGET:-290}  # seconds for the whole distillation; data generation <= GEN_BUDGET
GEN_BUDGET=${GEN_BUDGET:-120}
ARGS=${DISTILL_ARGS:---data humaneval,stdlib,chat,humaneval@chat --samples 3 --temperature 0.7
  --max-new-tokens 256 --gen-batch 256 --seq-len 512 --batch 32 --steps 6000 --warmup 40
  --lr 1e-3 --layers 2 --intermediate 512 --save-every 200}
BENCH_ARGS=(--budget-s 270)  # the section: h100 or h200 (common.device_tag)
if [ "${QUICK:-0}" = 1 ]; then  # tiny settings, the default model found where it is installed
  ARGS="--samples 0 --max-new-tokens 8 --max-prompt-tokens 32 --gen-batch 8 --seq-len 32
    --batch 2 --steps 3 --warmup 2"
  GEN_BUDGET=1 BUDGET=600 BENCH_ARGS=(--device-tag cpu-quick --prompts 2 --new 8)
else
  use_gguf || exit 1
fi
mkdir -p "$OUT"
if [ "${1:-}" = bench ]; then
  bench bench_distill 330 $PY benchmarks/bench_distill.py --draft "${DRAFT_DIR:-$RUN/draft}" \
    "${BENCH_ARGS[@]}" --out "$OUT/distill.json"
  exit
fi
rm -rf "$RUN"
if [ -n "${DATA_FROM:-}" ]; then mkdir -p "$RUN" && cp -r "$DATA_FROM" "$RUN/data" || exit 1; fi
bench distill 120 $PY -c "import jaxspec.io.default_model as m; m.default_checkpoint()"
# shellcheck disable=SC2086
bench distill $((BUDGET + 45)) $PY -m jaxspec.cli distill --out "$RUN" $ARGS --budget-s "$BUDGET" \
  --gen-budget-s "$GEN_BUDGET"
[ -f "$RUN/draft/draft.json" ] || { echo "no draft was written"; exit 1; }
tar -C "$RUN/draft" -cf "$OUT/${NAME:-smollm2-135m-instruct-draft}.tar" .
ls -l "$OUT/${NAME:-smollm2-135m-instruct-draft}.tar"
