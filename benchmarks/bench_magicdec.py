"""MagicDec on real weights and real long documents: speedup of batched self-speculation with a
sparse-KV draft over autoregressive decoding at the same batch and prefix.

    python benchmarks/bench_magicdec.py [--prefixes 2048,4096,7168] [--batches 1,128,64,32,8]
        [--drafts self-streaming,self-snapkv,NAME=DRAFT_DIR[:snapkv]] [--budget 512]
        [--gammas 2,3,4] [--tree D,W,K,BS] [--new 96]
        [--budget-s 400] [--out benchmarks/results/magicdec.json]

Target: SmolLM2-135M-Instruct (``JAXSPEC_DEFAULT_GGUF`` names the GGUF where the PyPI package
is missing), bf16 on a GPU, float32 on CPU, with the kernels of the ``JAXSPEC_*`` variables
(``settings.kernels``). Prompts: the ``longdoc`` set (CPython's Language Reference topics, PSF
licence) cut to each prefix with a summarise/continue instruction, in the chat template; each
row of a batch is another document. Greedy, EOS ignored (every row decodes ``--new`` tokens).

All of it runs through the engines' pieces, on the programs ``generate(method="magicdec")``
builds (``magicdec.ENGINE.program``; the autoregressive engine's for the baseline), the prompts
of a batch padded to one width so that one program per method and gamma serves every prefix. A
run is the engine's ``init`` (the prefill, untimed: ``measure.units.initial``), then its loop
(``engine.step`` under ``base.until_done``, as ``engine.decode`` runs it), timed on a copy of
that state: only decoding is timed. Each executable runs once untimed first (one step).

``speedup``: that run against autoregressive decoding, both until every row has its tokens (the
batch waits for its least predictable row). ``throughput_speedup``: MagicDec's own measure (its
``selfspec_benchmark.py``): the same steps until the *first* row has its tokens, every row's
decoded tokens over the wall time, against autoregressive tokens/s, as a server refilling
finished rows would see; those rows hold a prefix of their tokens
(``throughput_rows_prefix_identical``).

Cost model per (batch, prefix, draft): ``measure.cost_model`` on the engines' units timed by
``measure.units`` at the prompt's context (T_T: the autoregressive step; T_D: the chain propose
at gamma 1; T_V(gamma): the chain verify) and alpha from the run at the middle gamma, the mean
row's and the slowest row's (``batch_alpha``: the batch waits for it). The chosen gamma is
``Measurement.choose``'s, as ``generate(gamma="auto")`` chooses; every gamma is also run
(``--all-gammas``), so measured and predicted speedups stand side by side. ``--tree`` adds the
batched tree (T_E: one expansion; T_V(bs): its verify) and ``cost_model.choose_shape``'s pick.
``rows_identical``: batch rows whose tokens equal autoregressive decoding's (bf16 may part at
near-ties; float32 must not). Compiles go through the engines' one cache, never while anything
is timed. The JSON is written after every row; past ``--budget-s`` nothing new starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    default_dtype,
    default_target,
    fixed_call,
    initial,
    ints,
    log,
    metadata,
    unit_ms,
    write,
)
from jaxspec.engines import base, magicdec, programs  # noqa: E402
from jaxspec.measure import cost_model  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefixes", default="2048,4096,7168")
    p.add_argument(
        "--batches",
        default="1,128,64,32,8",
        help="measured in this order (default: the ends of the trend first, should the budget "
        "run out)",
    )
    p.add_argument(
        "--drafts",
        default="self-streaming,self-snapkv",
        help="comma-separated: self-streaming, self-snapkv, or NAME=DIR for a distilled draft "
        "checkpoint with a StreamingLLM cache of the same budget (NAME=DIR:snapkv for SnapKV)",
    )
    p.add_argument("--budget", type=int, default=512, help="the draft's KV budget (tokens)")
    p.add_argument("--gammas", default="2,3,4", help="gammas measured (T_V) and run")
    p.add_argument(
        "--tree",
        default=None,
        metavar="D,W,K,BS",
        help="also run batched trees of this shape (depth, width, branch, bs; e.g. 4,4,2,8) and "
        "let the cost model choose between them and the chains (off by default: more compiles)",
    )
    p.add_argument("--new", type=int, default=96, help="new tokens per row")
    p.add_argument("--reps", type=int, default=3, help="repetitions of the unit timings")
    p.add_argument(
        "--all-gammas",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run every measured gamma (default), not only the middle one and the chosen one",
    )
    p.add_argument("--budget-s", type=float, default=400.0, help="stop starting work after this")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--model", default=None, help="converted checkpoint (default: SmolLM2)")
    p.add_argument("--out", default=None, help="default: benchmarks/results/magicdec.json")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------- a timed run


def _decode(static, s, tflat, dflat):
    """The engine's loop from the state ``s`` to its last state (the donated input's buffers
    become it: no second cache): until every row is done (``base.until_done``, as
    ``engine.decode`` runs it), or with ``first`` until the first row is (MagicDec's throughput
    run)."""
    engine, prog, first = static

    def step(s):
        return engine.step(prog, tflat, dflat, s)

    if first:
        return jax.lax.while_loop(lambda s: ~jnp.any(s.out.done), step, s)
    return base.until_done(step, s, prog.chunk)


def decode(call, state, warm: set, *, first: bool = False) -> dict:
    """One timed run of ``call``'s loop from a copy of ``state``: its output and counts."""
    dflat = None if call.draft is None else call.draft.flat
    args = (state, call.target.flat, dflat)
    key = (jax.tree.structure(args), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args)))
    exe, _ = programs.compiled(_decode, (call.engine, call.prog, first), args, key, donate=(0,))
    if exe not in warm:  # its first run (slower), on a state one token short of the end
        last = state.out.tokens.shape[1] - 1
        out = dataclasses.replace(state.out, count=jnp.full_like(state.out.count, last))
        jax.block_until_ready(exe(fresh(dataclasses.replace(state, out=out)), *args[1:]))
        warm.add(exe)
    s = fresh(state)
    with programs.Timer() as t:
        out = jax.device_get(exe(s, *args[1:]).out)
    emitted, live = np.asarray(out.emitted), np.asarray(out.live_steps)
    return {
        "tokens": np.asarray(out.tokens),
        "count": np.asarray(out.count),
        "wall_s": t.s,
        "steps": int(out.steps),
        "length": float(emitted.sum() / max(live.sum(), 1)),
        "slowest": cost_model.slowest_row_length(emitted, live),
        "mean_row_steps": float(live.mean()),
    }


def fresh(tree):
    """A device copy (made outside the timed call, which donates it)."""
    return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


def throughput_ratio(ar_count, ar_s: float, sd_count, sd_s: float) -> float:
    """Speculative over autoregressive tokens/s, counting every row's decoded tokens (the first
    token, from the prefill, excluded) over each loop's wall time: MagicDec's throughput."""
    ar_tokens = float(np.sum(np.asarray(ar_count) - 1))
    sd_tokens = float(np.sum(np.asarray(sd_count) - 1))
    return (sd_tokens / sd_s) / (ar_tokens / ar_s)


def prefix_agreement(ar_out, ar_count, sd_out, sd_count) -> int:
    """Rows whose tokens are a prefix of autoregressive decoding's (a row stopped early)."""
    same = 0
    for a, na, s, ns in zip(ar_out, ar_count, sd_out, sd_count, strict=True):
        same += int(ns <= na and list(a[:ns]) == list(s[:ns]))
    return same


def agreement(ar: dict, sd: dict) -> tuple[int, list[int]]:
    """(rows whose tokens equal autoregressive decoding's, first differing index per other row)."""
    same, first = 0, []
    for a, na, s, ns in zip(ar["tokens"], ar["count"], sd["tokens"], sd["count"], strict=True):
        a, s = list(a[:na]), list(s[:ns])
        if a == s:
            same += 1
            continue
        n = min(len(a), len(s))
        first.append(next((i for i in range(n) if a[i] != s[i]), n))
    return same, first


def compared(ar: dict, sd: dict) -> dict:
    """A speculative run's figures against the autoregressive run of the same prompts."""
    same, first = agreement(ar, sd)
    return {
        "wall_s": sd["wall_s"],
        "tok_s": int(sd["count"].sum()) / sd["wall_s"],
        "speedup": ar["wall_s"] / sd["wall_s"],
        "acceptance_length": sd["length"],
        "steps": sd["steps"],
        "mean_row_steps": sd["mean_row_steps"],
        "rows_identical": same,
        "first_divergence": first,
    }


# ------------------------------------------------------------------------------- measuring


class Bench:
    """The run's settings, drafts and prompts, and the JSON being written."""

    def __init__(self, args, target, drafts_, result, t0):
        self.args, self.target, self.drafts = args, target, drafts_
        self.result, self.t0 = result, t0
        self.gammas = sorted(ints(args.gammas))
        self.mid = cost_model.middle(self.gammas)
        self.shape = tree_shape(args.tree)
        self.warm: set = set()  # executables that have run once

    def over(self) -> bool:
        return time.perf_counter() - self.t0 > self.args.budget_s

    def save(self) -> None:
        self.result["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.result["rows"].sort(key=lambda r: (r["batch"], r["prefix"], r["draft"]))
        write("magicdec.json", self.result, self.args.out)

    def skip(self, **where) -> None:
        self.result["not_run"].append({**where, "why": "--budget-s reached"})
        self.save()

    def call(self, ids, lens, draft: str | None, **options):
        method = "autoregressive" if draft is None else "magicdec"
        d, opts = (None, {}) if draft is None else self.drafts[draft]
        return fixed_call(
            self.target, ids, lens, method, draft=d, max_new=self.args.new, **opts, **options
        )

    def batch(self, b: int, inputs: dict) -> None:
        """Every row of batch ``b``: the autoregressive runs of each prefix, then each draft's
        rows (one draft's programs at a time: they serve every prefix)."""
        ars = {}
        for p, (ids, lens) in inputs.items():
            if self.over():
                self.skip(batch=b, prefix=p)
                continue
            ars[p] = self.autoregressive(ids, lens)
            rate = int(ars[p]["count"].sum()) / ars[p]["wall_s"]
            log(self.t0, f"batch {b} prefix {p}: autoregressive {rate:.0f} tok/s "
                f"(T_T {ars[p]['t_t']:.3f} ms)")  # fmt: skip
        for name in self.drafts:
            for p, ar in ars.items():
                if self.over():
                    self.skip(batch=b, prefix=p, draft=name)
                    continue
                self.draft_row(b, p, name, *inputs[p], ar)

    def autoregressive(self, ids, lens) -> dict:
        call = self.call(ids, lens, None)
        s = initial(call)
        t_t = unit_ms(call, s, "verify", self.args.reps)
        return {**decode(call, s, self.warm), "t_t": t_t}

    def chain(self, name, ids, lens, g: int, ar: dict, *, t_v=True, t_d=False, run=True) -> dict:
        """At gamma ``g``: T_V(g), T_D (at gamma 1: the propose of one token), and the
        fixed-length and throughput runs, as asked."""
        call = self.call(ids, lens, name, gamma=g)
        s = initial(call)
        got = {}
        if t_v:
            got["t_v"] = unit_ms(call, s, "verify", self.args.reps)
        if t_d:
            got["t_d"] = unit_ms(call, s, "draft", self.args.reps)
        if run:
            sd = decode(call, s, self.warm)
            fast = decode(call, s, self.warm, first=True)
            got.update(compared(ar, sd), slowest_length=sd["slowest"])
            got["alpha"] = magicdec.alpha_from_acceptance_length(sd["length"], g)
            got["throughput_speedup"] = throughput_ratio(
                ar["count"], ar["wall_s"], fast["count"], fast["wall_s"]
            )
            got["throughput_steps"] = fast["steps"]
            got["throughput_rows_prefix_identical"] = prefix_agreement(
                ar["tokens"], ar["count"], fast["tokens"], fast["count"]
            )
        return got

    def tree(self, name, ids, lens, ar: dict) -> tuple[cost_model.TreeMeasurement, dict]:
        """The batched tree of ``--tree`` with this draft: T_E, T_V(bs), the run and its
        measured accepted length (the cost model's inputs), and its speedup."""
        sh = self.shape
        call = self.call(ids, lens, name, shape="tree", **dataclasses.asdict(sh))
        s = initial(call)
        t_v = unit_ms(call, s, "verify", self.args.reps)
        sd = decode(call, s, self.warm)
        del s
        one = self.call(ids, lens, name, shape="tree", **{**dataclasses.asdict(sh), "depth": 1})
        t_e = unit_ms(one, initial(one), "draft", self.args.reps)
        tm = cost_model.TreeMeasurement(
            sh.depth, sh.width, sh.branch, sh.bs, t_e, t_v, acceptance_length=sd["length"],
            slowest_length=sd["slowest"],
        )  # fmt: skip
        row = {**dataclasses.asdict(sh), "t_e_ms": t_e, "t_v_ms": t_v}
        row.update(compared(ar, sd), predicted_speedup=1.0 / tm.relative_time(ar["t_t"]))
        return tm, row

    def draft_row(self, b, p, name, ids, lens, ar: dict) -> None:
        gammas, mid, args = self.gammas, self.mid, self.args
        got = {
            g: self.chain(
                name, ids, lens, g, ar, t_v=g in gammas, t_d=g == 1,
                run=g in gammas and (args.all_gammas or g == mid),
            )
            for g in sorted({1, *gammas})
        }  # fmt: skip
        t_d, t_t = got[1]["t_d"], ar["t_t"]
        t_v = {g: got[g]["t_v"] for g in gammas}
        runs = {g: r for g, r in got.items() if "speedup" in r}
        m = cost_model.Measurement(
            b, p, t_t, t_d, t_v, runs[mid]["alpha"], mid, runs[mid]["acceptance_length"],
            slowest_length=runs[mid]["slowest_length"],
        )  # fmt: skip
        gamma, predicted = m.choose(gammas)
        if gamma not in runs:
            runs[gamma] = self.chain(name, ids, lens, gamma, ar, run=True)
        tm, tree = self.tree(name, ids, lens, ar) if self.shape is not None else (None, None)
        shape, _, best = cost_model.choose_shape(m, tm, gammas)
        r = tree if shape == "tree" else runs[gamma]
        row = self.row(b, p, name, ar, m, gamma, predicted, runs)
        row.update(
            prefix_tokens_mean=float(np.asarray(lens).mean()), shape=shape, tree=tree,
            gamma=gamma if shape == "chain" else None, predicted_speedup=best,
            speedup=r["speedup"], acceptance_length=r["acceptance_length"], sd_tok_s=r["tok_s"],
            rows_identical=r["rows_identical"], first_divergence=r["first_divergence"],
            steps=r["steps"], mean_row_steps=r["mean_row_steps"], sd_wall_s=r["wall_s"],
        )  # fmt: skip
        self.result["rows"].append(row)
        self.save()
        log(
            self.t0,
            f"batch {b:>3} prefix {p:>5} {name:>14}: gamma {gamma} alpha {m.alpha:.2f} "
            f"speedup {r['speedup']:.2f}x (predicted {best:.2f}x; measured by gamma "
            + " ".join(f"{g}:{v['speedup']:.2f}" for g, v in runs.items())
            + f"; throughput {runs[gamma]['throughput_speedup']:.2f}x), "
            f"T_D/T_T {t_d / t_t:.2f}, {r['steps']} steps, {r['rows_identical']}/{b} rows "
            "identical",
        )

    def row(self, b, p, name, ar, m: cost_model.Measurement, gamma, predicted, runs) -> dict:
        """The row's chain figures: the cost model's terms and choice, each gamma's runs."""
        rel = cost_model.relative_time
        return {
            "batch": b,
            "prefix": p,
            "draft": name,
            "budget": self.args.budget,
            "chain_gamma": gamma,
            "alpha": m.alpha,
            "batch_alpha": m.batch_alpha,
            "alpha_gamma": m.alpha_gamma,
            "chain_predicted_speedup": predicted,
            "chain_speedup": runs[gamma]["speedup"],
            "ar_tok_s": int(ar["count"].sum()) / ar["wall_s"],
            "t_t_ms": m.t_t,
            "t_d_ms": m.t_d,
            "t_v_ms": m.t_v,
            "t_d_over_t_t": m.t_d / m.t_t,
            "t_v_over_t_t": {g: v / m.t_t for g, v in m.t_v.items()},
            "predicted_by_gamma": {
                g: 1.0 / rel(g, m.batch_alpha, m.t_d, m.t_t, v) for g, v in m.t_v.items()
            },
            "predicted_by_gamma_mean_alpha": {  # the mean row's alpha, for comparison
                g: 1.0 / rel(g, m.alpha, m.t_d, m.t_t, v) for g, v in m.t_v.items()
            },
            "measured_by_gamma": {g: v["speedup"] for g, v in runs.items()},
            # MagicDec's own measure (its selfspec benchmarks stop when the first row has its
            # tokens and count every row's): speculation's rate without the wait for the
            # batch's slowest row, as continuous batching would see it
            "throughput_speedup": runs[gamma]["throughput_speedup"],
            "throughput_by_gamma": {g: v["throughput_speedup"] for g, v in runs.items()},
            "throughput_steps": runs[gamma]["throughput_steps"],
            "throughput_rows_prefix_identical": runs[gamma]["throughput_rows_prefix_identical"],
            "alpha_by_gamma": {g: v["alpha"] for g, v in runs.items()},
            "best_measured_gamma": max(runs, key=lambda g: runs[g]["speedup"]),
            "rows": b,
            "all_gammas_rows_identical": {g: v["rows_identical"] for g, v in runs.items()},
            # verifications until the slowest row had its tokens (the loop's trip count)
            "steps_by_gamma": {g: v["steps"] for g, v in runs.items()},
            "ar_steps": ar["steps"],
            "ar_wall_s": ar["wall_s"],
        }


# ------------------------------------------------------------------------------- main


def tree_shape(text):
    if not text:
        return None
    from jaxspec.engines.tree import TreeShape

    depth, width, branch, bs = ints(text)
    return TreeShape(depth=depth, width=width, branch=branch, bs=bs)


def draft_specs(text: str) -> dict[str, str]:
    """``--drafts`` as {row name: spec}: a self draft's name is its spec; ``NAME=DIR[:snapkv]``
    names a distilled draft checkpoint."""
    out = {}
    for item in (x.strip() for x in text.split(",")):
        if item:
            name, _, spec = item.partition("=")
            out[name] = spec or name
    return out


def resolve(target, spec: str, budget: int) -> tuple[object, dict]:
    """(draft, magicdec options) of a ``draft_specs`` value: a sparse-KV self draft, or a
    distilled draft Model over a sparse cache of the same budget (StreamingLLM, or SnapKV with
    ``:snapkv``)."""
    from jaxspec.io.draft_checkpoint import load_draft

    if spec.startswith("self-"):
        return spec, {"budget": budget}
    snap = spec.endswith(":snapkv")
    path = spec.removesuffix(":snapkv")
    return load_draft(path, target), {"budget": budget, "sparse": "snapkv" if snap else "streaming"}


def batch_inputs(target, docs: dict, b: int) -> dict:
    """Each prefix's first ``b`` documents, all padded to one width (the widest prefix's): one
    program per method and gamma serves every prefix of the batch."""
    from jaxspec.model.prefill import pad_prompts

    rows = [r for p in docs for r in docs[p][:b]]
    ids, lens = pad_prompts(rows, target.net().kernels)
    return {p: (ids[i * b : (i + 1) * b], lens[i * b : (i + 1) * b]) for i, p in enumerate(docs)}


def main(argv=None) -> int:
    args = parse(argv)
    t0 = time.perf_counter()
    from jaxspec.io import datasets

    dtype = default_dtype(args.dtype)
    prefixes, batches, gammas = ints(args.prefixes), ints(args.batches), sorted(ints(args.gammas))
    target = default_target(args.model, dtype)
    log(t0, f"loaded {args.model or 'SmolLM2-135M-Instruct'} as {dtype.name} on {jax.devices()[0]}")
    names = draft_specs(args.drafts)
    drafts_ = {name: resolve(target, spec, args.budget) for name, spec in names.items()}
    shape = tree_shape(args.tree)
    room = max(max(gammas), shape.depth if shape else 0) + 1
    sparse = {}  # the drafts' checks (the window holds a block) before anything runs
    for name, (d, opts) in drafts_.items():
        o = magicdec.Options(gamma=max(gammas), **opts)
        sparse[name] = str(magicdec.resolve_draft(target, d, o, None)[0].sparse)
    # prompts: a different document per row, chat template, `prefix` tokens each
    docs = {p: datasets.longdoc_prompts(target.tokenizer, max(batches), p) for p in prefixes}
    longest = max(len(r) for rows in docs.values() for r in rows)
    if longest + args.new + room > target.config.max_position_embeddings:
        sys.exit(f"prefix {longest} + {args.new} new tokens exceed the model's context")
    log(t0, f"prompts: {len(prefixes)} prefixes x {max(batches)} documents")
    result = {
        **metadata(),
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
        "dtype": dtype.name,
        "dataset": datasets.longdoc_source(),
        "instruction": datasets.LONGDOC_INSTRUCTION,
        "settings": {
            "prefixes": prefixes,
            "batches": batches,
            "drafts": names,  # name: what it is
            "budget": args.budget,
            "sparse": sparse,
            "gammas": gammas,
            "new_tokens": args.new,
            "greedy": True,
            "eos": "ignored (every row decodes new_tokens)",
            "timed": "decoding only (the engines' init untimed), whole loop on device",
            "kernels": target.net().kernels.describe(),
            "prompt_width": {},  # per batch: every prefix padded to it
            "tree": None if shape is None else dataclasses.asdict(shape),
        },
        "rows": [],
        "not_run": [],
    }
    bench = Bench(args, target, drafts_, result, t0)
    for b in batches:
        if bench.over():
            bench.skip(batch=b)
            continue
        inputs = batch_inputs(target, docs, b)
        result["settings"]["prompt_width"][b] = int(inputs[prefixes[0]][0].shape[1])
        bench.batch(b, inputs)
    bench.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
