"""Prefill time of a model shape (random bf16 weights) by attention path and chunk (issue 10).

The engines' own ``prefill`` (``jaxspec.model.prefill``, what every engine's ``init`` runs) in
one program with the cache donated, through the engines' compile cache, for each context,
prefill chunk (``KernelConfig.prefill_chunk``) and attention implementation
(``KernelConfig.attention``: 'reference' is the jnp path, 'auto' the backend's default: the
Pallas kernels on a GPU, the flash kernel for chunks wider than 64 tokens); the other kernel
choices are those of the ``JAXSPEC_*`` variables. Prints one JSON row per setting (with its
resolved ``kernels``) and writes them all to ``--out``.

    python benchmarks/probe_prefill.py --contexts 1024,4096 --chunks 256,1024,4096 \\
        --impls reference,auto --out prefill.json
    python benchmarks/probe_prefill.py --shape smoke --contexts 64 --chunks 32 \\
        --impls reference          # CPU check of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_decode_gpu import SHAPES
from benchmarks.common import default_dtype, ints, metadata, random_target
from jaxspec.engines import programs
from jaxspec.kernels import KernelConfig
from jaxspec.model.kv_cache import init_cache
from jaxspec.model.prefill import prefill


def time_prefill(model, kernels: KernelConfig, context: int, batch: int, reps: int):
    """(row, the first row's last logits) of ``reps`` timed prefills after two untimed ones."""
    cfg, net = model.config, model.net(kernels)
    ids = np.asarray(
        jax.random.randint(jax.random.key(context), (batch, context), 0, cfg.vocab_size), np.int32
    )
    lens = np.full((batch,), context, np.int32)
    cache = init_cache(cfg, batch, context + 144, model.dtype)
    args = (model.flat, cache, ids, lens)
    key = (model.layout, programs.shapes_key(*jax.tree.leaves(cache), ids, lens))
    exe, compile_s = programs.compiled(prefill, net, args, key, donate=(1,))
    times, logits = [], None
    for i in range(reps + 2):
        with programs.Timer() as t:
            last, cache = exe(model.flat, cache, ids, lens)
            last.block_until_ready()
        if i >= 2:
            times.append(t.s)
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
        "kernels": net.kernels.describe(),
    }
    return row, logits


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smol", choices=sorted(SHAPES))
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--chunks", default="256,1024,4096")
    ap.add_argument("--impls", default="reference,auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = random_target(SHAPES[args.shape], dtype=default_dtype())
    rows = []
    for context in ints(args.contexts):
        for chunk in ints(args.chunks):
            if chunk > context or context % chunk:
                continue
            base_logits = None  # the first implementation's: the others are compared to them
            for impl in args.impls.split(","):
                row = dict(
                    shape=args.shape, batch=args.batch, context=context, chunk=chunk, attention=impl
                )
                try:
                    kernels = dataclasses.replace(
                        model.kernels, attention=impl, prefill_chunk=chunk
                    )
                    got, logits = time_prefill(model, kernels, context, args.batch, args.reps)
                    row.update(got)
                    if base_logits is None:
                        base_logits = logits
                    else:
                        diff = float(np.abs(logits - base_logits).max())
                        row["max_logit_diff"] = round(diff, 5)
                except Exception as e:  # one setting failing (memory) keeps the others
                    row["error"] = repr(e)[:300]
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(metadata(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
