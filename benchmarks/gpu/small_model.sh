#!/usr/bin/env bash
# Small-model latency on one H200 (bench_small_model.py): the real SmolLM2-135M-Instruct at batch
# 1, generate() timed as a user calls it, at 1K and 4K tokens of context: autoregressive, chains
# and trees with the shipped draft, the shipped feature head and prompt lookup, the first token
# after the 4K prompt, the PyTorch CUDA-graph peer on the same weights and prompt in the same
# call (its script carried beside the first GGUF part: lib.sh's stash keeps it in ~/peer), the
# float32 exactness check. Needs
# the GGUF (README.md). About 7 minutes on an H200; on an H100 (258c7dd, 7deed54) it ran past its
# 570 s limit in the peer's section (since stopped once its rows are in: PEER_ROWS), so there run
# two calls: `--contexts 1024`, then `--contexts 4096 --no-stream --no-f32` (about 70 s on an
# H100 at c21442e), and `python benchmarks/bench_small_model.py --merge FIRST SECOND` (it adds
# the second's contexts). Writes $OUT/small_model.json (results/small_model.json) after each
# section.
#   bash benchmarks/gpu/small_model.sh --contexts 1024 --no-f32
# With --random-weights, the streaming rows alone on random SmolLM2-shape weights: no GGUF, one
# call (then --merge them into results/small_model.json).
set -u
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
case " $* " in *" --random-weights "*) ;; *) use_gguf || exit 1 ;; esac
peer=()
[ -f ~/peer/torch_cudagraph.py ] && peer=(--peer ~/peer/torch_cudagraph.py)
bench small_model 570 python3 benchmarks/bench_small_model.py --draft "$DRAFT" --feature "$FEATURE" \
  --new 128 --repeats 3 --stream-steps 16,32,64,128 "${peer[@]}" --out "$OUT/small_model.json" "$@"
