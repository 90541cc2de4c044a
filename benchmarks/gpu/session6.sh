#!/usr/bin/env bash
# GPU calls of the sixth developers' session. Before the first call:
#   git rev-parse --short HEAD > .carry1/commit
#
#   call 1 (nvidia-h200, carry .carry1 .whl): stash the GGUF's first half, install gguf; then
#          probe_small.py under XLA option variants (issue 10: Hopper's programmatic dependent
#          launch, PDL, lets a kernel start while its predecessor drains, which is what a chain of
#          491 ~2 us kernels pays for), and at batch 64/128 (issue 5: where a batched step's
#          time goes; batch 128 x 512 tokens is the MagicDec self-draft's step).
#          (Run at 0b1da63. The machine went back before the next call, so call 2 stashes again.)
#   call 2 (nvidia-h200, carry .carry1 .whl): the stash of call 1, then tune_attention.py: the
#          decode-attention kernel's tiling for SmolLM2's heads at batch 1-128.
#   call 3 (carry .carry2): join the GGUF; bench_small_model with chain at gamma 4, 6 and 8
#          (issue 10: prompt lookup accepts 2.35 at gamma 6 against 2.12 at 4,
#          results/gamma_sweep_cpu.json; 2x autoregressive needs a 7-token verify <= 1.28 ms).
#   call 4 (no carry, right after 3): bench_magicdec, self-streaming and the distilled draft, with
#          MagicDec's own throughput measure beside the fixed-length one (issue 5).
#   call 5 (nvidia-h200): the kernel's new default tiling for 64-wide heads (128-slot KV blocks, 3
#          stages; tune_attention.py of call 2) against the old one (JAXSPEC_ATTN_BLOCK_K=64
#          JAXSPEC_ATTN_STAGES=2) inside the real step (probe_small), and the kernel against the
#          float32 reference at SmolLM2's heads on the GPU.
#   call 6 (nvidia-h200-x2): run at 3024a1d; its trace had no module spans (no "XLA Modules"
#          line in these GPU traces). call 7: the same, spans rebuilt from the kernels' hlo_module
#          stat, plus a depth d - 1 variant.
#   (calls 6 and 7, nvidia-h200-x2, no carry): the SwiftSpec 8B/1B iteration with a profiler
#          trace of both GPUs (issue 4).
#   call 8 (nvidia-h200-x2, no carry; planned, not run: the session's GPU time ran out): the
#          on-device loop (loop="device", 305d188) against the threaded loop and the serial tree
#          engine at d = 2.
#
#   bash benchmarks/gpu/session6.sh 1|2|3|4|5|6|7|8
set -u
source benchmarks/gpu/env.sh
probe() {  # label, then probe_small arguments; XLA_FLAGS from the caller
  timeout 120 python3 benchmarks/gpu/probe_small.py --label "$@" 2>&1 \
    | grep -v "^W0000\|^I0000\|^E0000" | python3 -c "
import json,sys
t=sys.stdin.read(); i=t.find('{')
if i < 0: print(t[-800:]); sys.exit()
r=json.loads(t[i:t.rfind('}')+1])
print(r['label'], r['batch'], r['context'], 'ms', round(r['ms_per_step'],4), 'kernels', r.get('kernels_per_step'), 'busy', r.get('gpu_busy_ms_per_step'), 'mean_us', r.get('mean_kernel_us'))
print('   top', r.get('top'), r.get('trace_error',''))"
}
stash() {
  mkdir -p ~/gguf && cp .carry1/gguf.part00 ~/gguf/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target ~/site .whl/*.whl
  ls -la ~/gguf
}
case "${1:?call 1 to 8}" in
1)
  stash
  probe default
  XLA_FLAGS="--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true" probe pdl_on
  XLA_FLAGS="--xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false" probe pdl_off
  XLA_FLAGS="--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true" probe heroless
  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" probe no_triton_gemm
  probe b128_c512 --batch 128 --context 512 --steps 16
  probe b64_c2048 --batch 64 --context 2048 --steps 16
  probe b128_c2048 --batch 128 --context 2048 --steps 16
  cp /tmp/probe_*.json "$OUT/" 2>/dev/null; ls "$OUT"
  ;;
2)
  stash
  timeout 500 python3 benchmarks/gpu/tune_attention.py 2>&1 | grep -v "^W0000\|^I0000\|^E0000"
  ;;
3)
  cat ~/gguf/gguf.part00 .carry2/gguf.part01 > ~/smol.gguf
  echo "$(cat .carry2/sha256)  $HOME/smol.gguf" | sha256sum -c || exit 1
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  timeout 560 python3 benchmarks/bench_small_model.py \
    --draft checkpoints/drafts/smollm2-135m-instruct-draft --new 128 --repeats 3 --gammas 6,8 \
    --out "$OUT/small_model.json" 2>&1 | grep -v "^W0000\|^I0000" | tail -30
  ;;
4)
  export JAXSPEC_DEFAULT_GGUF=~/smol.gguf
  D=checkpoints/drafts/smollm2-135m-instruct-draft
  timeout 560 python3 benchmarks/bench_magicdec.py --batches 1,128,64,32,8 \
    --drafts "self-streaming,distilled=$D" --gammas 2,3,4 --budget-s 400 \
    --out "$OUT/magicdec.json" 2>&1 | grep -v "^W0000\|^I0000" | tail -40
  ;;
5)
  python3 - <<'PY'
import jax, jax.numpy as jnp
from pallas_kernels.reference import attend  # (jaxspec first: it imports the kernels)
from pallas_kernels.decode_attention import decode_attention, plan
for b, s, t in ((1, 1000, 1), (1, 4000, 1), (128, 500, 1), (8, 2000, 7), (4, 333, 1)):
    ks = jax.random.split(jax.random.key(b * s + t), 3)
    q = jax.random.normal(ks[0], (b, t, 9, 64), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s + 24, 3, 64), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s + 24, 3, 64), jnp.bfloat16)
    length = jnp.full((b,), s, jnp.int32) - jnp.arange(b, dtype=jnp.int32) % 7
    bm = jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0)
    got = decode_attention(q, k, v, length, bm).astype(jnp.float32)
    want = attend(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), length, bm)
    err = float(jnp.max(jnp.abs(got - want)))
    print("check", b, s, t, plan(b, s + 24, 3, t * 3, head_dim=64)["block_k"], "max err", err)
    assert err < 0.05, err
PY
  for c in "1 1024" "1 4096" "128 512" "64 2048" "128 2048"; do
    set -- $c
    probe "new_b$1_c$2" --batch "$1" --context "$2" --steps 32
    JAXSPEC_ATTN_BLOCK_K=64 JAXSPEC_ATTN_STAGES=2 probe "old_b$1_c$2" --batch "$1" --context "$2" --steps 32
  done
  ;;
6|7)
  timeout 560 python3 benchmarks/bench_swiftspec_2gpu.py --trace /tmp/sstrace \
    --out "$OUT/swiftspec_2gpu.json" 2>&1 | grep -v "^W0000\|^I0000" | tail -30
  ;;
8)
  timeout 500 python3 benchmarks/bench_swiftspec_2gpu.py --loops-only 2 \
    --out "$OUT/swiftspec_2gpu_loops.json" 2>&1 | grep -v "^W0000\|^I0000" | tail -20
  ;;
esac
