#!/usr/bin/env bash
# Two back-to-back calls on one warm nvidia-h200 (the machine stays warm ~30 s between calls).
# Before the first: git rev-parse --short HEAD > .carry1/commit.
#
#   call 1 (carry .carry1 .whl): stash the GGUF's first half, install the gguf wheel; probe a
#          SmolLM2-shape decode step under several XLA options (issue 10).
#   call 2 (carry .carry2): join the GGUF, check its sha256; distil the shipped draft at full
#          budget and benchmark it (issue 7, benchmarks/gpu/distill.sh).
#
#   call 3 (carry .carry1 .whl): as call 1's first half; the fused projection kernels' tests on
#          the GPU; the SmolLM2-shape step with and without them (issue 10).
#   call 4 (carry .carry2): join the GGUF; a second distillation recipe (more sampled data).
#   call 5: bench_small_model on the real SmolLM2 with the better draft (issue 10).
#
#   bash benchmarks/gpu/session4.sh 1|2|3|4|5
set -u
source benchmarks/gpu/env.sh
case "${1:?call 1 to 5}" in
1)
  mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/ &
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target ~/site .whl/*.whl &
  P=benchmarks/gpu/probe_small.py
  DUMP_HLO=1 timeout 90 python3 $P --label default 2>&1 | grep -v "^W0000\|^I0000" | tail -40
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout 80 python3 $P --label cmdbuf_off 2>&1 | tail -30
  XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL" \
    timeout 80 python3 $P --label cmdbuf_while 2>&1 | tail -30
  XLA_FLAGS="--xla_gpu_graph_min_graph_size=1" timeout 80 python3 $P --label graph_min1 2>&1 | tail -30
  JAXSPEC_MIN_GEMM_ROWS=16 timeout 80 python3 $P --label rows16 2>&1 | tail -30
  timeout 80 python3 $P --label ctx4096 --context 4096 2>&1 | tail -30
  wait
  ls -la ~/gguf
  ;;
2)
  cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
  echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  DISTILL_BUDGET=250 GEN_BUDGET=100 BENCH_BUDGET=110 bash benchmarks/gpu/distill.sh
  ;;
3)
  mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/ &
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target ~/site .whl/*.whl &
  JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_fused_linear.py -k "match or rope" 2>&1 | tail -15
  P=benchmarks/gpu/probe_small.py
  for ctx in 1024 4096; do
    timeout 80 python3 $P --label fused_$ctx --context $ctx 2>&1 | grep -v "^W0000\|^I0000" | tail -40
    JAXSPEC_FUSED_LINEAR=off timeout 80 python3 $P --label off_$ctx --context $ctx 2>&1 \
      | grep "ms_per_step\|kernels_per\|busy"
  done
  wait
  ls -la ~/gguf
  ;;
4)
  cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
  echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  DISTILL_ARGS="--data humaneval,chat,humaneval@chat --samples 32 --temperature 0.7
    --max-new-tokens 256 --gen-batch 256 --seq-len 512 --batch 32 --steps 4000 --warmup 40
    --lr 1e-3 --layers 2 --intermediate 512 --ce-weight 0.5 --save-every 200" \
    DISTILL_BUDGET=280 GEN_BUDGET=110 BENCH_BUDGET=100 bash benchmarks/gpu/distill.sh
  cp "$OUT/distill.json" ~/distill2.json
  ;;
5)
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  # the second recipe's draft when it accepts more than the shipped one (FIRST_ACC: the shipped
  # draft's acceptance length from the same benchmark, call 2)
  D=$(python3 -c "
import json, os
r = {x['name']: x for x in json.load(open(os.path.expanduser('~/distill2.json')))['h200']['results']}
new = r['distilled']['acceptance_length_mean']
print(os.path.expanduser('~/distill-run/draft') if new > float('${FIRST_ACC:-2.38}')
      else 'checkpoints/drafts/smollm2-135m-instruct-draft')
" 2>/dev/null || echo checkpoints/drafts/smollm2-135m-instruct-draft)
  echo "draft: $D"
  timeout 560 python3 benchmarks/bench_small_model.py --draft "$D" --new 128 --repeats 3 \
    --out "$OUT/small_model.json" 2>&1 | grep -v "^W0000\|^I0000" | tail -30
  ;;
esac
