"""Chain acceptance length by gamma on the small-model benchmark's prompt (issue 10).

The prompt is ``bench_small_model``'s: the first 20 HumanEval prompts concatenated, cut so the
cache holds ``ctx`` tokens by the end. Acceptance length is a property of the model, draft and
text, not of the machine: a float32 CPU run predicts the H200's (bf16 may part at near-ties).
What a longer gamma costs is the GPU's question: ``bench_small_model.py --gammas``.

    python benchmarks/bench_gamma_sweep.py [--contexts 1024] [--gammas 3,4,6,8] [--new 128]
        [--draft checkpoints/drafts/smollm2-135m-instruct-draft] [--out gamma_sweep.json]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from benchmarks.bench_small_model import context_ids
from benchmarks.common import metadata, write
from jaxspec.api import generate
from jaxspec.io.convert import load
from jaxspec.io.default_model import default_checkpoint
from jaxspec.io.draft_checkpoint import SHIPPED, load_draft


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--gammas", default="3,4,6,8")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--draft", default=str(SHIPPED))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    model = load(default_checkpoint(progress=False), dtype=dtype)
    drafts = {"ngram": "ngram", "distilled": load_draft(args.draft, model)}
    rows = []
    for ctx in [int(c) for c in args.contexts.split(",") if c]:
        ids = context_ids(model, ctx, args.new)
        ar = generate(model, [ids], max_new_tokens=args.new).tokens[0]
        for name, draft in drafts.items():
            for g in [int(x) for x in args.gammas.split(",") if x]:
                t0 = time.perf_counter()
                r = generate(
                    model, [ids], max_new_tokens=args.new, method="chain", draft=draft, gamma=g
                )
                rows.append(
                    {
                        "context": ctx,
                        "draft": name,
                        "gamma": g,
                        "acceptance_length": round(r.stats["acceptance_length"], 3),
                        "verifications": r.stats["target_steps"] - 1,
                        "same_as_autoregressive": r.tokens[0] == ar,
                    }
                )
                print(rows[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    payload = {
        **metadata(),
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
        "dtype": str(jnp.dtype(dtype)),
        "draft_path": args.draft,
        "prompt": "bench_small_model.context_ids: HumanEval prompts 0-19 concatenated (MIT)",
        "new_tokens": args.new,
        "rows": rows,
    }
    name = "gamma_sweep_gpu.json" if jax.default_backend() == "gpu" else "gamma_sweep_cpu.json"
    return write(name, payload, args.out)


if __name__ == "__main__":
    main()
