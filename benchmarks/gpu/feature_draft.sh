#!/usr/bin/env bash
# The feature draft (an EAGLE-1 head) through the public generate(): bench_feature_draft.py, one
# prompt set a call (the budget keeps it inside the call). Needs the GGUF (README.md: its parts over three calls).
#   bash benchmarks/gpu/feature_draft.sh [SET] [CONFIGS]     # SET: humaneval (default) or chat
# FEATURE_DIR: another feature draft (default: the shipped one). The results file's sections
# per set come from separate calls; join them into results/feature_draft.json.
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
PY=${PY:-python3}
use_gguf || exit 1
mkdir -p "$OUT"
bench feature_draft 300 $PY benchmarks/bench_feature_draft.py \
  --feature "${FEATURE_DIR:-checkpoints/drafts/smollm2-135m-instruct-feature}" \
  --sets "${1:-humaneval}" \
  --configs "${2:-autoregressive,distilled,feature,feature-tree,feature-chain6,feature-tree6}" \
  --budget-s 260 --out "$OUT/feature_draft.json"
