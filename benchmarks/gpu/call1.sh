#!/usr/bin/env bash
# GPU call 1 (nvidia-h200-x2, carry .carry1 .whl): stash the GGUF's first half, install the gguf
# wheel, then the synthetic SwiftSpec run (8B-shape target on GPU 0, 1B-shape draft on GPU 1).
set -u
source benchmarks/gpu/env.sh
mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target ~/site .whl/*.whl
python3 -c "import jax, gguf; print(jax.__version__, jax.devices())"
timeout 330 python3 benchmarks/bench_swiftspec_2gpu.py --out "$OUT/swiftspec_2gpu.json" \
  2>&1 | tee "$OUT/swiftspec_2gpu.log" | grep -v "^\s*$" | tail -40
