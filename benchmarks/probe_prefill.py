"""Prefill time of a model shape (random bf16 weights) by attention path and chunk (issues 10, 28).

The engines' own ``prefill`` (``jaxspec.model.prefill``, what every engine's ``init`` runs) in
one program with the cache donated, through the engines' compile cache, for each context,
prefill chunk (``KernelConfig.prefill_chunk``), attention implementation
(``KernelConfig.attention``: 'reference' is the jnp path, 'auto' the backend's default: the
Pallas kernels on a GPU, the flash kernel for chunks wider than 64 tokens) and first-chunk path
(``KernelConfig.prefill_attention``: 'off', 'cudnn', 'xla'); the other kernel choices are those
of the ``JAXSPEC_*`` variables. ``--cupti`` adds each setting's kernel time by kind (GPU).
``--first-token`` times the first token of the real SmolLM2-135M-Instruct after a prompt of
each of those lengths through ``generate``, as ``bench_small_model`` does, for each
first-chunk path (needs the GGUF). Prints one JSON row per setting (with its resolved
``kernels``) and writes them all to ``--out``.

    python benchmarks/probe_prefill.py --contexts 1024,4096 --chunks 2048,4096 \\
        --modes off,cudnn --cupti --out prefill.json
    python benchmarks/probe_prefill.py --shape smoke --contexts 64 --chunks 32 \\
        --impls reference --modes off,xla          # CPU check of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_decode_gpu import SHAPES  # noqa: E402
from benchmarks.common import default_dtype, ints, metadata, random_target  # noqa: E402
from jaxspec.engines import programs  # noqa: E402
from jaxspec.kernels import KernelConfig  # noqa: E402
from jaxspec.model.kv_cache import init_cache  # noqa: E402
from jaxspec.model.prefill import prefill  # noqa: E402


def by_kind(exe, args) -> dict:
    """CUPTI's kernel times of one run of ``exe``, summed by kind: {kind: [ms, kernels]}."""
    from jax.experimental.mosaic.gpu import profiler

    _, runs = profiler.measure(exe, aggregate=False, iterations=3)(*args)
    out: dict = {}
    for name, ms in runs[-1]:
        n = name.lower()
        kind = next((k for k in KINDS if k in n), "other")
        ms0, count = out.get(kind, (0.0, 0))
        out[kind] = [round(ms0 + ms, 3), count + 1]
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))


KINDS = ("prefill_attention", "cudnn", "gemm", "sm90", "scatter", "loop", "concatenate")


def time_prefill(
    model, kernels: KernelConfig, context: int, batch: int, reps: int, cupti: bool = False
):
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
    kinds = None
    if cupti:  # the same prefill without donation: the profiler runs it on the same cache
        plain = jax.jit(lambda *a: prefill(net, *a)[0])
        fresh = init_cache(cfg, batch, context + 144, model.dtype)
        kinds = by_kind(plain, (model.flat, fresh, ids, lens))
    row = {
        "ms": round(ms, 3),
        "tok_per_s": round(batch * context / ms * 1e3),
        "compile_s": round(compile_s, 1),
        "first_token": int(np.argmax(logits)),
        "top2_gap": round(float(top2[1] - top2[0]), 5),
        "kernels": net.kernels.describe(),
    }
    if kinds is not None:
        row["kernel_ms_by_kind"] = kinds
        row["kernel_ms"] = round(sum(v[0] for v in kinds.values()), 3)
    return row, logits


def first_tokens(contexts, modes, repeats: int) -> list[dict]:
    """The first token's wall through ``generate`` after a prompt of each length, real SmolLM2
    (bf16 on a GPU), for each first-chunk path, the modes alternated twice."""
    from benchmarks.bench_small_model import timed
    from benchmarks.common import context_ids
    from jaxspec.io.convert import load
    from jaxspec.io.default_model import default_checkpoint

    model = load(default_checkpoint(), dtype=default_dtype())
    rows = []
    for context in contexts:
        ids = context_ids(model, context, 128)
        for mode in list(modes) * 2:
            r = timed(model, ids, 1, repeats, kernels=KernelConfig(prefill_attention=mode))
            row = dict(model="smollm2-135m-instruct", context=context, prefill_attention=mode,
                       first_token_ms=round(1e3 / r["wall_tok_per_s"], 2),
                       outside_ms=r["outside_ms"], token=r["tokens"][0])  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smol", choices=sorted(SHAPES))
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--chunks", default="256,1024,4096")
    ap.add_argument("--impls", default="auto")
    ap.add_argument("--modes", default="off,cudnn", help="KernelConfig.prefill_attention values")
    ap.add_argument("--cupti", action="store_true", help="kernel time by kind (GPU)")
    ap.add_argument("--first-token", action="store_true", help="real SmolLM2's first token")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.first_token:
        rows = first_tokens(ints(args.contexts), args.modes.split(","), args.reps)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(metadata(), rows=rows), f, indent=1)
        return
    model = random_target(SHAPES[args.shape], dtype=default_dtype())
    rows = []
    for context in ints(args.contexts):
        for chunk in ints(args.chunks):
            if chunk > context or context % chunk:
                continue
            base_logits = None  # the first implementation's: the others are compared to them
            for impl, mode in itertools.product(args.impls.split(","), args.modes.split(",")):
                row = dict(shape=args.shape, batch=args.batch, context=context, chunk=chunk,
                           attention=impl, prefill_attention=mode)  # fmt: skip
                try:
                    kernels = dataclasses.replace(
                        model.kernels, attention=impl, prefill_chunk=chunk, prefill_attention=mode
                    )
                    got, logits = time_prefill(
                        model, kernels, context, args.batch, args.reps, args.cupti
                    )
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
