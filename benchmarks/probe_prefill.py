"""Prefill time of a model shape (random bf16 weights) by attention path and chunk (issue 10).

The engines' own ``prefill`` (``jaxspec.engines.base``) in one jit with the cache donated, for
each context, prefill chunk and attention implementation
(``jaxspec.model.transformer.ATTENTION_IMPL``: 'reference' is the jnp path, 'auto' the Pallas
kernels: the flash kernel for chunks wider than 64 tokens). Prints one JSON row per setting and
writes them all to ``--out``.

    python benchmarks/probe_prefill.py --contexts 1024,4096 --chunks 256,1024,4096 \\
        --impls reference,auto --out prefill.json
    python benchmarks/probe_prefill.py --shape smoke --contexts 64 --chunks 32 \\
        --impls reference          # CPU check of the script
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec.model.transformer as jm
from benchmarks.bench_decode_gpu import SHAPES
from benchmarks.common import metadata
from jaxspec.engines.base import prefill
from jaxspec.model.kv_cache import init_cache


def time_prefill(model, context: int, chunk: int, batch: int, reps: int) -> dict:
    cfg = model.config
    ids = jax.random.randint(jax.random.key(context), (batch, context), 0, cfg.vocab_size)
    lens = jnp.full((batch,), context, jnp.int32)

    def run(params, cache):
        last, cache = prefill(
            model.graphdef, params, cache, ids, lens, vocab=cfg.vocab_size, chunk=chunk
        )
        return last, cache

    fn = jax.jit(run, donate_argnums=1)
    t0 = time.perf_counter()
    exe = fn.lower(model.params, init_cache(cfg, batch, context + 144, model.dtype)).compile()
    compile_s = time.perf_counter() - t0
    cache = init_cache(cfg, batch, context + 144, model.dtype)
    times, logits = [], None
    for i in range(reps + 2):
        t0 = time.perf_counter()
        last, cache = exe(model.params, cache)
        last.block_until_ready()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        logits = np.asarray(last[0]) if logits is None else logits
        cache.length = jnp.zeros_like(cache.length)
    ms = sorted(times)[len(times) // 2] * 1e3
    top2 = np.sort(logits)[-2:]
    row = {
        "ms": round(ms, 3),
        "tok_per_s": round(batch * context / ms * 1e3),
        "compile_s": round(compile_s, 1),
        "first_token": int(np.argmax(logits)),
        "top2_gap": round(float(top2[1] - top2[0]), 5),
    }
    return row, logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smol", choices=sorted(SHAPES))
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--chunks", default="256,1024,4096")
    ap.add_argument("--impls", default="reference,auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    model = jm.new_model(SHAPES[args.shape], seed=0, dtype=dtype)
    rows = []
    for context in map(int, args.contexts.split(",")):
        for chunk in map(int, args.chunks.split(",")):
            if chunk > context or context % chunk:
                continue
            base = None  # the first implementation's logits: the others are compared to them
            for impl in args.impls.split(","):
                jm.ATTENTION_IMPL = impl
                row = dict(
                    shape=args.shape, batch=args.batch, context=context, chunk=chunk, attention=impl
                )
                try:
                    got, logits = time_prefill(model, context, chunk, args.batch, args.reps)
                    row.update(got)
                    if base is None:
                        base = logits
                    else:
                        row["max_logit_diff"] = round(float(np.abs(logits - base).max()), 5)
                except Exception as e:  # one setting failing (memory) keeps the others
                    row["error"] = repr(e)[:300]
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(metadata(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
