"""The feature draft (an EAGLE-1 head over SmolLM2's hidden states) against the shipped small
draft, through the public ``jaxspec.generate`` at batch 1: pooled acceptance length (tokens per
target verification, summed over the prompts) and wall tokens/s against autoregressive decoding.

    python benchmarks/bench_feature_draft.py                          # CPU float32: humaneval
    python benchmarks/bench_feature_draft.py --feature random --prompts 1 --new 8   # smoke run
    python3 benchmarks/bench_feature_draft.py --sets chat --device-tag h200 \\
        --merge-from ~/feature_draft.json --out $OUT/feature_draft.json     # GPU, one set a call

Prompts: the first ``--prompts`` HumanEval prompts (OpenAI, MIT licence), raw: held out of both
drafts' training data; ``chat``: the first MT-Bench first turns (LMSYS FastChat, Apache-2.0) in the
chat template (in both drafts' training data). Rows (``--configs``): ``autoregressive``;
``distilled``: chain, gamma 4, the shipped small draft; ``feature``: chain, gamma 4, the feature
draft; ``feature-tree``: the tree engine's default shape with it (a feature draft's, by backend:
depth 4 and bs 8 on a GPU, 5 and 11 on a CPU; rows of runs before the GPU's default moved, named
``feature-tree4``, carry it too, and their ``feature-tree`` rows the old default, depth 6 and bs
16: each row records its options);
``feature-chain6`` and ``feature-tree6`` (depth 6, bs 16) on request, and ``feature-tree-DxBS``
for any other depth D and bs BS.
Each call is timed around ``generate`` as a user makes it (host work included); a call that
compiled (a new prompt width) runs again and the second is timed. Every row's tokens are compared
with autoregressive decoding's: in float32 they must all be equal (the script exits 1 otherwise).
``--feature random`` drafts with an untrained head (acceptance near 1: it checks the pipeline and
the exactness, not the speed); ``--model`` takes another converted target (its drafts then must be
its own).

Writes ``benchmarks/results/feature_draft.json``: one section per device (``--device-tag``), one
part per prompt set, rows with ``acceptance_length_pooled`` (the issue's measure), merged into
the existing file. Prompts run in the outer loop and rows in the inner one, the JSON is written
after every prompt, and ``--budget-s`` stops in time (every row then has the same prompts).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import re
import statistics
import sys
import time

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, default_target, device_tag, metadata  # noqa: E402
from jaxspec.api import generate  # noqa: E402
from jaxspec.cli.parser import draft_vocab  # noqa: E402
from jaxspec.io import datasets  # noqa: E402
from jaxspec.io.draft_checkpoint import SHIPPED, load_draft  # noqa: E402
from jaxspec.model.feature_head import random_head  # noqa: E402
from jaxspec.model.vocab_head import vocab_size_of  # noqa: E402
from jaxspec.prompts import encode_prompts  # noqa: E402

FEATURE = ROOT / "checkpoints" / "drafts" / "smollm2-135m-instruct-feature"
CONFIGS = {  # name: (method, draft key, options)
    "autoregressive": ("autoregressive", None, {}),
    "distilled": ("chain", "distilled", {"gamma": 4}),
    "feature": ("chain", "feature", {"gamma": 4}),
    "feature-tree": ("tree", "feature", {}),  # a feature draft's default (tree.FEATURE_SHAPE)
    "feature-chain6": ("chain", "feature", {"gamma": 6}),
    "feature-tree6": ("tree", "feature", {"depth": 6, "bs": 16}),
}
TREE_KEYS = ("depth", "width", "branch", "bs")
SHAPED = re.compile(r"feature-tree-(\d+)x(\d+)")  # feature-tree-DxBS: a tree of that depth, bs


def config(name: str) -> tuple:
    """``(method, draft key, options)`` of a row: a ``CONFIGS`` name, or ``feature-tree-DxBS``
    (the feature draft's tree at depth D and bs BS, the other tree options the engine's)."""
    if name in CONFIGS:
        return CONFIGS[name]
    shaped = SHAPED.fullmatch(name)
    if shaped is None:
        raise KeyError(name)
    return "tree", "feature", {"depth": int(shaped[1]), "bs": int(shaped[2])}


DEFAULT = "autoregressive,distilled,feature,feature-tree"


def timed_call(target, ids, draft, method, opts, new: int):
    """One ``generate`` call as a user makes it (again if it compiled): (result, wall s)."""
    kw = dict(draft=draft, method=method, max_new_tokens=new, **opts)
    for _ in range(2):
        t0 = time.perf_counter()
        r = generate(target, [ids], **kw)
        wall = time.perf_counter() - t0
        if r.stats["compile_s"] == 0:
            break
    return r, wall


def run_of(i: int, ids, r, wall: float, ref) -> dict:
    """One prompt's record of a row."""
    return {
        "prompt": i,
        "prompt_tokens": len(ids),
        "new_tokens": len(r.tokens[0]),
        "wall_s": round(wall, 5),
        "acceptance_length": round(r.stats["acceptance_length"], 4),
        "target_steps": r.stats["target_steps"],
        "same_as_autoregressive": r.tokens[0] == ref,
        **({"tree_shape": {k: r.stats[k] for k in TREE_KEYS}} if "bs" in r.stats else {}),
    }


def row_of(name: str, runs: list[dict]) -> dict:
    """A config's row over its prompts: pooled acceptance = tokens the verifications produced
    over the verifications (the prefill's first token apart), tokens/s over the summed wall."""
    method, _, opts = config(name)
    new = sum(r["new_tokens"] for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    verifies = sum(r["target_steps"] - 1 for r in runs)
    made = sum(r["acceptance_length"] * (r["target_steps"] - 1) for r in runs)
    return {
        "name": name,
        "method": method,
        "options": {**(runs[0].get("tree_shape", {}) if runs else {}), **opts},  # as it ran
        "prompts": len(runs),
        "new_tokens": new,
        "target_verifications": verifies,
        "acceptance_length_pooled": round(made / max(verifies, 1), 4)
        if method != "autoregressive"
        else 1.0,
        "acceptance_length_mean": round(statistics.mean(r["acceptance_length"] for r in runs), 4),
        "tokens_per_s": round(new / wall, 2),
        "median_call_s": round(statistics.median(r["wall_s"] for r in runs), 5),
        "identical_to_autoregressive": sum(r["same_as_autoregressive"] for r in runs),
        "per_prompt": runs,
    }


def summary(rows: list[dict]) -> dict:
    """Speedups over the autoregressive row, the pooled acceptance per row, the best feature
    row (by wall tokens/s)."""
    ar = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_vs_autoregressive"] = round(r["tokens_per_s"] / ar, 3)
    feature = [r for r in rows if r["name"].startswith("feature")]
    best = max(feature, key=lambda r: r["tokens_per_s"], default=None)
    return {
        "acceptance_length_pooled": {r["name"]: r["acceptance_length_pooled"] for r in rows},
        "speedup_vs_autoregressive": {r["name"]: r["speedup_vs_autoregressive"] for r in rows},
        "best_feature": None if best is None else best["name"],
        "best_feature_speedup": None if best is None else best["speedup_vs_autoregressive"],
    }


def prompt_set(target, name: str, n: int) -> tuple[list[list[int]], str]:
    """Token ids of the first ``n`` prompts of a set (chat turns in the chat template, as
    ``generate(..., chat=True)`` wraps them), and a caption."""
    texts = datasets.humaneval(n) if name == "humaneval" else datasets.chat(n)
    ids = encode_prompts(texts, target.tokenizer, target.config, chat=datasets.chat_template(name))
    caption = {
        "humaneval": f"HumanEval first {n} prompts (MIT), raw; held out of both drafts' data",
        "chat": f"MT-Bench first {n} first turns (Apache-2.0), chat template; in the drafts' data",
    }[name]
    return ids, caption


def call_order(names: list[str], i: int) -> list[str]:
    """The rows' order on prompt ``i``: autoregressive first (its tokens are the reference), the
    others rotated by ``i``, so each takes every place after it equally often. (One H100 run in
    a fixed order, 2026-12-08, had a config 1.64x autoregressive in second place that another had
    at 1.99x in last place: benchmarks/notes/feature_draft.md.)"""
    first, rest = names[:1], names[1:]
    k = i % len(rest) if rest else 0
    return first + rest[k:] + rest[:k]


def run_set(target, drafts, name, args, deadline, write) -> dict:
    """Every config on the set's prompts (prompts outer): the set's part of the section."""
    ids, caption = prompt_set(target, name, args.prompts)
    names = args.configs.split(",")
    part = {"dataset": caption, "complete": False, "results": []}
    runs: dict[str, list[dict]] = {c: [] for c in names}
    for i, p in enumerate(ids):
        if deadline is not None and time.perf_counter() > deadline:
            break
        ref = None
        for c in call_order(names, i):
            method, key, opts = config(c)
            r, wall = timed_call(target, p, drafts.get(key), method, opts, args.new)
            ref = r.tokens[0] if method == "autoregressive" else ref
            runs[c].append(run_of(i, p, r, wall, ref))
        part["results"] = [row_of(c, runs[c]) for c in names]
        part.update(summary(part["results"]))
        write(part)  # a call cut short keeps the prompts done
        line = "  ".join(
            f"{r['name']} {r['tokens_per_s']:.1f}/s acc {r['acceptance_length_pooled']:.2f}"
            for r in part["results"]
        )
        print(f"[{name} {i + 1}/{len(ids)}] {line}", flush=True)
    part["complete"] = len(runs[names[0]]) == len(ids)
    return part


def load_drafts(target, args) -> dict:
    """The drafts the rows use: ``distilled`` (``--small``) and ``feature`` (``--feature``: a
    folder, or ``random`` for an untrained head)."""
    keys = {config(c)[1] for c in args.configs.split(",")} - {None}
    drafts = {}
    if "distilled" in keys:
        drafts["distilled"] = load_draft(args.small, target, vocab=args.draft_vocab)
    if "feature" in keys and args.feature == "random":
        drafts["feature"] = random_head(target)
    elif "feature" in keys:
        if not pathlib.Path(args.feature).exists():
            sys.exit(
                f"no feature draft at {args.feature}: train one with `jaxspec distill --kind "
                "feature --out RUN` (checkpoints/README.md) and pass --feature RUN, or pass "
                "--feature random for a smoke run"
            )
        drafts["feature"] = load_draft(args.feature, target, vocab=args.draft_vocab)
    return drafts


def draft_info(path) -> dict:
    if path == "random":
        return {"path": None, "kind": "feature", "note": "untrained random head (smoke run)"}
    meta_path = pathlib.Path(path) / "draft.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    training = meta.get("training", {})
    shown = pathlib.Path(path).absolute()
    return {
        "path": str(shown.relative_to(ROOT)) if shown.is_relative_to(ROOT) else str(path),
        "kind": meta.get("kind", "model"),
        "layers": meta.get("config", {}).get("num_layers"),
        "stored_parameters": meta.get("parameters"),
        "trained_steps": training.get("steps"),
        "tokens_seen": training.get("tokens_seen"),
        "trained_on": training.get("device"),
    }


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--feature", default=str(FEATURE), help="the feature draft's folder, or random")
    ap.add_argument("--model", default=None, help="target checkpoint (default: SmolLM2)")
    ap.add_argument("--small", default=str(SHIPPED), help="the small draft's folder")
    ap.add_argument("--sets", default="humaneval", help="humaneval, chat (comma-separated)")
    ap.add_argument(
        "--configs", default=DEFAULT, help=f"rows, of: {', '.join(CONFIGS)}, feature-tree-DxBS"
    )
    ap.add_argument(
        "--draft-vocab", type=draft_vocab, default="default", metavar="N|default|full",
        help="the drafts' heads: load_draft's vocab (jaxspec.model.vocab_head)",
    )  # fmt: skip
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--device-tag", default=None, help="section name (default: cpu / h200 / ...)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop within about this long")
    ap.add_argument("--merge-from", default=str(RESULTS / "feature_draft.json"))
    ap.add_argument("--out", default=str(RESULTS / "feature_draft.json"))
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    known = all(c in CONFIGS or SHAPED.fullmatch(c) for c in names)
    if names[0] != "autoregressive" or not known:
        ap.error(
            f"--configs starts with autoregressive and takes {', '.join(CONFIGS)} or "
            "feature-tree-DxBS (depth D, bs BS)"
        )
    return args


def main(argv=None) -> int:
    args = parse(argv)
    t0 = time.perf_counter()
    deadline = None if args.budget_s is None else t0 + args.budget_s
    target = default_target(args.model)  # bf16 on a GPU, float32 elsewhere
    dtype = jax.numpy.dtype(target.dtype)
    drafts = load_drafts(target, args)
    tag = args.device_tag or device_tag()
    base = {}
    if pathlib.Path(args.merge_from).is_file():
        base = json.loads(pathlib.Path(args.merge_from).read_text())
    section = base.get(tag, {}) | {
        **metadata(),
        "model": f"{target.name} ({dtype.name})",
        "kernels": target.net().kernels.describe(),
        "max_new_tokens": args.new,
        "batch": 1,
        "greedy": True,
        "timing": "wall of the whole public generate() call, compile excluded",
        "drafts": {k: draft_info(args.small if k == "distilled" else args.feature) for k in drafts},
        "draft_vocab": {k: vocab_size_of(d) or "full" for k, d in drafts.items()},
    }
    section.setdefault("sets", {})

    def write(name=None, part=None):
        if name is not None:
            section["sets"][name] = part
        base[tag] = section
        base.update({k: section[k] for k in ("date", "device", "jax", "commit", "command")})
        base["what"] = (
            "acceptance_length_pooled: tokens per target verification summed over the prompts, "
            "per draft row; tokens/s of the public generate() against autoregressive, batch 1. "
            "One section per device, one part per prompt set."
        )
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(base, indent=2) + "\n")

    for name in args.sets.split(","):
        part_done = functools.partial(write, name)
        section["sets"][name] = run_set(target, drafts, name, args, deadline, part_done)
    section["wall_s"] = round(time.perf_counter() - t0, 1)
    write()
    print(f"wrote {args.out} [{tag}]")
    return report(section, args.sets.split(","), dtype)


def report(section, sets, dtype) -> int:
    """The table, and exit status 1 when a float32 run parted from autoregressive decoding."""
    bad = []
    for name in sets:
        print(f"\n{name}: {'':>12} {'tok/s':>8} {'accept':>7} {'speedup':>8} {'same':>6}")
        for r in section["sets"][name]["results"]:
            print(f"{r['name']:>18} {r['tokens_per_s']:8.1f} {r['acceptance_length_pooled']:7.2f} "
                  f"{r.get('speedup_vs_autoregressive', 1):7.2f}x "
                  f"{r['identical_to_autoregressive']:>2}/{r['prompts']}")  # fmt: skip
            if r["identical_to_autoregressive"] != r["prompts"]:
                bad.append(f"{name}/{r['name']}")
    if dtype == jax.numpy.float32 and bad:
        print(f"ERROR: float32 outputs differ from autoregressive for {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
