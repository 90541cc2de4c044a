"""Acceptance length by gamma (chains) and by tree shape on the small-model benchmark's prompt.

The prompt is ``bench_small_model``'s (``common.context_ids``): the first 20 HumanEval prompts
concatenated, cut so the cache holds ``ctx`` tokens by the end. Acceptance length is a property
of the model, draft and text, not of the machine: a float32 CPU run predicts the H200's (bf16
may part at near-ties). What a longer gamma costs is the GPU's question (``bench_verify.py``).
Trees (``--trees``, each ``DEPTHxWIDTHxBRANCHxBS``) run with the
model draft only: a prompt-lookup tree is one looked-up path. The kernels are those of the
``JAXSPEC_*`` variables (``kernels``).

    python benchmarks/bench_gamma_sweep.py [--contexts 1024] [--gammas 3,4,6,8] [--new 128]
        [--trees 3x8x4x8,4x8x4x8,6x8x4x16] [--draft checkpoints/drafts/smollm2-135m-instruct-draft]
        [--out gamma_sweep.json]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.common import context_ids, default_target, ints, metadata, write  # noqa: E402
from jaxspec.api import generate  # noqa: E402
from jaxspec.io.draft_checkpoint import SHIPPED, load_draft  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--gammas", default="3,4,6,8")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument(
        "--trees",
        default="3x8x4x8,4x8x4x8,4x4x2x8,6x8x4x8,6x8x4x16,8x8x4x16,4x1x4x8,6x1x4x8",
        help="tree shapes DEPTHxWIDTHxBRANCHxBS, comma-separated ('' for none)",
    )
    ap.add_argument("--draft", default=str(SHIPPED))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model = default_target()
    drafts = {"ngram": "ngram", "distilled": load_draft(args.draft, model)}
    rows = []
    for ctx in ints(args.contexts):
        ids = context_ids(model, ctx, args.new)
        ar = generate(model, [ids], max_new_tokens=args.new).tokens[0]
        runs = [
            (name, draft, f"chain {g}", {"method": "chain", "gamma": g})
            for name, draft in drafts.items()
            for g in ints(args.gammas)
        ]
        for shape in filter(None, args.trees.split(",")):
            depth, width, branch, bs = (int(x) for x in shape.split("x"))
            tree = {"depth": depth, "width": width, "branch": branch, "bs": bs}
            label = f"tree {depth}x{width}x{branch}x{bs}"
            runs.append(("distilled", drafts["distilled"], label, {"method": "tree", **tree}))
        for name, draft, proposal, options in runs:
            t0 = time.perf_counter()
            r = generate(model, [ids], max_new_tokens=args.new, draft=draft, **options)
            rows.append(
                {
                    "context": ctx,
                    "draft": name,
                    "proposal": proposal,
                    **{k: v for k, v in options.items() if k != "method"},
                    "acceptance_length": round(r.stats["acceptance_length"], 3),
                    "verifications": r.stats["target_steps"] - 1,
                    "same_as_autoregressive": r.tokens[0] == ar,
                }
            )
            print(rows[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    payload = {
        **metadata(),
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
        "dtype": jnp.dtype(model.dtype).name,
        "kernels": model.net().kernels.describe(),
        "draft_path": args.draft,
        "prompt": "common.context_ids: HumanEval prompts 0-19 concatenated (MIT)",
        "new_tokens": args.new,
        "rows": rows,
    }
    name = "gamma_sweep_gpu.json" if jax.default_backend() == "gpu" else "gamma_sweep_cpu.json"
    return write(name, payload, args.out)


if __name__ == "__main__":
    main()
