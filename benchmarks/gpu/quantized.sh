#!/usr/bin/env bash
# Quantized weights (issue 22) on one H200 (nvidia-h200): the dequantizing kernels' tests compiled
# on the GPU (float32 and bfloat16; the WGMMA kernel's, bf16), then bench_quantized.py: the decode
# check, the kernels' tile sweep, Llama-3-8B-shape decode steps in bf16 / int8 / int4 and
# SmolLM2-shape bf16 / Q4_1 (random weights), and the real SmolLM2-135M Q4_1 kept quantized
# against dequantized to bf16 (needs the GGUF, README.md: without it that section is not run and
# the committed one stays, its date and commit under "carried"). About 4 minutes on an H100
# (2026-12-06).
# Writes $OUT/quantized.json (results/quantized.json: the committed CPU section kept beside this
# run's GPU one), $OUT/quantized.log, $OUT/quantized_tests.log.
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
sections=check,sweep,steps,real
use_gguf || sections=check,sweep,steps
bench quantized_tests 150 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider \
  tests/test_quant_kernels.py
# the WGMMA kernel's products, compiled (its CPU tests only lower it): the tests marked gpu
bench quantized_tests 100 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider \
  -m gpu tests/test_quant_wgmma.py
[ -f benchmarks/results/quantized.json ] && cp benchmarks/results/quantized.json "$OUT/quantized.json"
# the real section takes about 80 s after the others' 180 (2026-12-03: a 240 s limit cut it)
bench quantized 330 python3 benchmarks/bench_quantized.py --sections "$sections" --budget-s 250 \
  --out "$OUT/quantized.json"
