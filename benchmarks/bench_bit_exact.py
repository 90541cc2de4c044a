"""Bit-exact bf16: rows of speculative output that part from autoregressive output, and what the
invariant numerics (``KernelConfig(invariant=True)``) cost.

    python benchmarks/bench_bit_exact.py --ar-only --refs refs.json [--model ...]  # process 1
    python benchmarks/bench_bit_exact.py [--model smollm2|1b] [--prompts 16] [--new 64]
        [--batches 1,16] [--refs refs.json] [--out benchmarks/results/bit_exact.json]

A ragged set of prompts (HumanEval prompts, OpenAI, MIT licence, cut to 16 lengths from 24 to
600 tokens) decoded greedily in bf16, ``--new`` tokens each, by autoregressive decoding and by
chain, tree and magicdec with each draft kind (prompt lookup, a draft model, the self-drafts'
sparse caches, a feature head: SmolLM2's shipped EAGLE-1 head, a random one for the 1B shape),
in the default numerics and in the invariant ones.
Batch 1 runs each prompt alone (the first ``--b1-prompts``, cut to the first one's padded width
so that every call has one shape and compiles once: 24 and 32 tokens for two; the 1B-shape rows
before 2026-12-05 ran 24 and 40, each row says which), batch 16 all at once. A row
*parts* when its tokens differ from the autoregressive tokens of the same numerics, decoded in
this process; with ``--refs`` (written by an earlier ``--ar-only`` process), also when they
differ from that other process's (``parted_rows_other_process``). Tokens/s is
the engines' own (``stats.tokens_per_s``), summed over the calls. ``smollm2`` is the real
SmolLM2-135M-Instruct with its shipped draft (``--draft``); ``1b`` a random-weights
Llama-3.2-1B shape with a 2-layer truncation as its draft (partings there are about numerics
only: random logits have many near-ties). Every JSON row is ``{"method", "draft", "batch",
"model", "parted_rows", "tok_per_s_invariant", "tok_per_s_default"}`` plus details.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import jaxspec  # noqa: E402
from benchmarks.common import humaneval_prompts, metadata, write  # noqa: E402
from benchmarks.shapes import LLAMA32_1B, SMOKE  # noqa: E402
from jaxspec.io.convert import load  # noqa: E402
from jaxspec.io.default_model import default_checkpoint  # noqa: E402
from jaxspec.io.draft_checkpoint import SHIPPED, SHIPPED_FEATURE, load_draft  # noqa: E402
from jaxspec.model.feature_head import random_head  # noqa: E402
from jaxspec.model.prefill import pad_prompts  # noqa: E402
from jaxspec.model.transformer import truncate  # noqa: E402

LENGTHS = (24, 40, 57, 80, 96, 120, 150, 180, 220, 260, 300, 350, 400, 460, 520, 600)
RUNS = (  # method, draft kind, options
    ("chain", "ngram", {"gamma": 8}),
    ("chain", "model", {"gamma": 4}),
    ("tree", "model", {}),
    ("magicdec", "self-streaming", {"gamma": 3, "budget": 256}),
    ("magicdec", "model", {"gamma": 3, "budget": 256}),
    ("chain", "feature", {"gamma": 4}),
    ("tree", "feature", {}),
    ("magicdec", "feature", {"gamma": 3, "budget": 256}),
    ("tree", "ngram", {}),
    ("magicdec", "self-snapkv", {"gamma": 3, "budget": 256}),
)


def prompts_for(model, n: int) -> list[list[int]]:
    if model.tokenizer is not None:
        ids = model.tokenizer.encode("\n".join(humaneval_prompts(40)))
    else:
        ids = np.random.RandomState(0).randint(4, model.config.vocab_size, 4096).tolist()
    return [ids[i * 37 : i * 37 + LENGTHS[i % len(LENGTHS)]] for i in range(n)]


def decode(target, groups, new, kernels, **kw):
    """Tokens of every prompt and tokens/s over the calls."""
    tokens, made, wall = [], 0, 0.0
    for g in groups:
        jaxspec.generate(target, g, max_new_tokens=new, kernels=kernels, **kw)  # compile
        r = jaxspec.generate(target, g, max_new_tokens=new, kernels=kernels, **kw)
        tokens += r.tokens
        made += r.stats["new_tokens"]
        wall += r.stats["wall_s"]
    return tokens, made / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("smollm2", "1b", "smoke"), default="smollm2")
    ap.add_argument("--draft", default=str(SHIPPED))
    ap.add_argument("--feature", default=str(SHIPPED_FEATURE), help="smollm2's feature head")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--b1-prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runs", default="", help="comma-separated method:draft to keep (default all)")
    ap.add_argument("--refs", default=None, help="autoregressive tokens of another process")
    ap.add_argument("--ar-only", action="store_true", help="write --refs and stop")
    ap.add_argument(
        "--plain-draft", action="store_true",
        help="the draft without its GPU kernels (fused and Pallas attention off), to tell a "
        "draft kernel's effect on the target from the target's own numerics",
    )  # fmt: skip
    ap.add_argument("--merge", nargs="+", default=None, help="join these outputs' rows and stop")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.merge:
        write("bit_exact.json", merged(args.merge), args.out)
        return
    keep = {tuple(r.split(":")) for r in args.runs.split(",") if r}
    runs = [r for r in RUNS if not keep or r[:2] in keep]
    dtype = jnp.dtype(args.dtype)
    if args.model == "smollm2":
        target = load(default_checkpoint(), dtype=dtype)
        small = load_draft(args.draft, target)
        head = load_draft(args.feature, target)
    else:
        shape = SMOKE if args.model == "smoke" else LLAMA32_1B  # smoke: tiny, for a CPU check
        target = jaxspec.new_model(shape, seed=0, dtype=dtype)
        small = truncate(target, 2)
        head = random_head(target)
    target.kernels = jaxspec.KernelConfig.from_env()
    plain = dict(fused_attention="off", fused_linear="off", fused_commit="off")
    invariant = jaxspec.KernelConfig(
        invariant=True, **(dict(plain, attention="reference") if args.plain_draft else {})
    )  # the target's resolved kernels are the same either way; the draft keeps the rest
    prompts = prompts_for(target, args.prompts)
    payload = {**metadata(), "model": args.model, "dtype": str(dtype), "new_tokens": args.new,
               "prompt_lengths": [len(p) for p in prompts],
               "draft_kernels": "plain" if args.plain_draft else "default", "rows": []}  # fmt: skip
    other = (
        json.loads(pathlib.Path(args.refs).read_text()) if args.refs and not args.ar_only else {}
    )
    refs = {}
    for batch in [int(b) for b in args.batches.split(",") if b]:
        groups = [prompts] if batch > 1 else [[p] for p in alone(prompts[: args.b1_prompts])]
        ref = {k: decode(target, groups, args.new, k)[0] for k in (None, invariant)}
        refs[str(batch)] = {"default": ref[None], "invariant": ref[invariant]}
        if args.ar_only:
            continue
        for method, kind, opts in runs:
            draft = {"model": small, "feature": head}.get(kind, kind)
            t0 = time.perf_counter()
            got = {
                k: decode(target, groups, args.new, k, method=method, draft=draft, **opts)
                for k in (None, invariant)
            }
            row = {
                "method": method,
                "draft": kind,
                "batch": batch,
                "model": args.model,
                "parted_rows": sum(
                    a != b for a, b in zip(got[invariant][0], ref[invariant], strict=True)
                ),  # fmt: skip
                "parted_rows_default": sum(
                    a != b for a, b in zip(got[None][0], ref[None], strict=True)
                ),  # fmt: skip
                "rows": len(ref[None]),
                "prompt_lengths": [len(p) for g in groups for p in g],
                "parted_rows_other_process": parted(got[invariant][0], other, batch, "invariant"),
                "parted_rows_default_other_process": parted(got[None][0], other, batch, "default"),
                "tok_per_s_invariant": round(got[invariant][1], 1),
                "tok_per_s_default": round(got[None][1], 1),
                "seconds": round(time.perf_counter() - t0, 1),
                "first_parted": first_parted(got[invariant][0], ref[invariant]),
            }
            row["invariant_over_default"] = round(
                row["tok_per_s_invariant"] / row["tok_per_s_default"], 3
            )
            payload["rows"].append(row)
            print(row, flush=True)
            write("bit_exact.json", payload, args.out)
    if args.ar_only:
        pathlib.Path(args.refs).write_text(json.dumps(refs))
        print(f"wrote {args.refs}")


def alone(prompts: list[list[int]]) -> list[list[int]]:
    """Batch-1 prompts, each cut to the first one's padded width (``pad_prompts``): one shape,
    so a run compiles its programs once instead of once per prompt (a batch-1 run is
    compile-bound: 35-73 s for two widths on the 1B shape)."""
    width = pad_prompts(prompts[:1], jaxspec.KernelConfig())[0].shape[1]
    return [p[:width] for p in prompts]


def first_parted(tokens, ref) -> list[dict]:
    """Each parted row: its index, the first token index where it parts, both tokens there."""
    out = []
    for row, (a, b) in enumerate(zip(tokens, ref, strict=True)):
        i = next(
            (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        if a != b:
            out.append({"row": row, "index": i, "spec": a[i : i + 1], "ar": b[i : i + 1]})
    return out


def merged(paths: list[str]) -> dict:
    """One payload of several outputs (processes that split the runs between them, or calls of
    other models, commits or GPUs): the first one's metadata, each row with its part's commit,
    date and device, the rows by model, batch 16 before batch 1, then in ``RUNS`` order. A row
    measured again (same model, batch, method and draft) keeps the later part's measurement:
    list the parts oldest first."""
    parts = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    order = {r[:2]: i for i, r in enumerate(RUNS)}
    latest = {
        (r["model"], r["batch"], r["method"], r["draft"]): {
            **r,
            "commit": r.get("commit", p["commit"]),
            "date": r.get("date", p["date"]),
            "device": r.get("device", p["device"]),
        }
        for p in parts
        for r in p["rows"]
    }
    rows = list(latest.values())
    rows.sort(key=lambda r: (r["model"], -r["batch"], order[(r["method"], r["draft"])]))
    commands = sorted({c for p in parts for c in p.get("commands", [p["command"]])})
    models = sorted({r["model"] for r in rows})
    commits = sorted({r["commit"] for r in rows})
    devices = sorted({r["device"] for r in rows})
    return {**parts[0], "date": max(r["date"] for r in rows),
            "model": models[0] if len(models) == 1 else models,
            "commit": commits[0] if len(commits) == 1 else "per row",
            "device": devices[0] if len(devices) == 1 else "per row: " + ", ".join(devices),
            "command": "the JSON's commands (one a process), joined by bench_bit_exact.py --merge",
            "processes": len(commands), "commands": commands, "rows": rows}  # fmt: skip


def parted(tokens, other: dict, batch: int, numerics: str) -> int | None:
    """Rows of ``tokens`` that differ from another process's autoregressive tokens (None: no
    such reference)."""
    ref = other.get(str(batch), {}).get(numerics)
    return None if ref is None else sum(a != b for a, b in zip(tokens, ref, strict=True))


if __name__ == "__main__":
    main()
