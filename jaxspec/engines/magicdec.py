"""MagicDec (arXiv 2408.11049): batched long-context speculation with a sparse-KV draft.

The draft's KV cache has a fixed budget, so its step costs about the same at any context while
the target's grows with it: past a critical length, speculation pays off even at large batch.
Drafts: ``"self-streaming"`` (the target with a StreamingLLM cache: ``sinks`` first tokens plus a
ring of the recent ``window``), ``"self-snapkv"`` (the target with a SnapKV cache: positions the
last ``obs`` prompt queries attend to most plus the recent ``window``), or a small draft Model
with either cache (``sparse="streaming" | "snapkv"``; ``"dense"`` keeps its full cache).

The decoding loop is the chain engine's (``chain.decode``: the whole loop on device, ragged
per-row acceptance, EOS per row); this module picks the draft and gamma. ``gamma="auto"`` (the
default) measures T_T, T_D, T_V(gamma) and alpha on this machine (jaxspec.measure.cost_model) once
per (models, batch, prefix bucket) and takes the gamma the cost model predicts fastest.

Batched trees (beyond MagicDec, which is chain-only): ``shape="tree"`` verifies a batch of token
trees instead (the tree engine's loop, ``tree.decode``: best-first growth by the same sparse-KV
draft, one tree-masked verify of the best ``bs`` nodes per row, ragged per-row acceptance, the
draft's ring committed along each row's accepted path). ``shape="auto"`` (the default, when
neither ``gamma`` nor a tree option fixes the shape) also measures the tree (T_E per expansion,
T_V(bs), its acceptance length) and runs whichever the cost model predicts faster.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxspec.engines import chain, tree
from jaxspec.engines.base import execute, spec_chunk, speculative_stats
from jaxspec.engines.options import positive_int, reject_unknown
from jaxspec.errors import DraftError, OptionError
from jaxspec.measure import cost_model
from jaxspec.spec import drafts, tree_drafts

TREE_OPTIONS = ("depth", "width", "branch", "bs")
OPTIONS = ("gamma", "shape", "budget", "sinks", "window", "obs", "pool", "sparse", *TREE_OPTIONS)
GAMMAS = range(1, 9)
SHAPES = ("auto", "chain", "tree")

_MEASURED: dict = {}


def resolve_draft(target, draft, *, sparse=None, **budget):
    """(draft object, its params) for MagicDec: a sparse-KV self draft, or a draft Model with a
    sparse (default "streaming") or "dense" cache."""
    from jaxspec.model.transformer import Model

    if draft == "ngram":
        raise DraftError(
            "method='magicdec' speculates with a sparse-KV draft: pass draft='self-streaming', "
            "'self-snapkv' or a draft Model; for prompt lookup use method='chain'."
        )
    if sparse not in (None, "streaming", "snapkv", "dense"):
        raise OptionError(f"sparse must be 'streaming', 'snapkv' or 'dense', got {sparse!r}.")
    if isinstance(draft, Model):
        sparse = "streaming" if sparse is None else sparse
        sparse = None if sparse == "dense" else sparse
    elif sparse is not None:
        raise OptionError(
            f"sparse={sparse!r} applies to a draft Model; with draft={draft!r} the kind of "
            "cache is in the name ('self-streaming' or 'self-snapkv')."
        )
    return drafts.resolve(target, draft, "magicdec", sparse=sparse, **budget)


def middle(gammas) -> int:
    """The gamma alpha is measured at: the middle of the candidates (alpha, the per-token
    acceptance rate, hardly depends on it)."""
    g = sorted(gammas)
    return g[len(g) // 2]


def auto_gamma(target, d, dparams, ids, lens, *, gammas=None) -> cost_model.Measurement:
    """The cost model's measurement for this (target, draft, batch, prefix bucket), cached."""
    gammas = tuple(GAMMAS if gammas is None else gammas)
    b = ids.shape[0]
    bucket = cost_model.prefix_bucket(int(lens.max()))
    key = (target.config, target.graphdef, d, b, bucket, gammas)
    if key not in _MEASURED:
        _MEASURED[key] = cost_model.measure(
            target, d, b, bucket, gammas, dparams=dparams, ids=ids, lens=lens,
            alpha_gamma=middle(gammas),
        )  # fmt: skip
    return _MEASURED[key]


def tree_draft(d, shape: tree.TreeShape) -> tree_drafts.ModelTreeDraft:
    """The tree-growing form of a resolved MagicDec draft: the same model, the same sparse
    (or dense) cache, trees of ``shape.capacity`` nodes."""
    return tree_drafts.ModelTreeDraft(
        d.graphdef, d.cfg, shape.capacity, d.sparse, d.reuse_target_cache
    )


def auto_tree(target, td, dparams, shape, ids, lens) -> cost_model.TreeMeasurement:
    """The cost model's tree measurement for this (target, draft, shape, batch, bucket), cached."""
    b = ids.shape[0]
    bucket = cost_model.prefix_bucket(int(lens.max()))
    key = ("tree", target.config, target.graphdef, td, shape, b, bucket)
    if key not in _MEASURED:
        _MEASURED[key] = cost_model.measure_tree(
            target, td, shape, b, bucket, dparams=dparams, ids=ids, lens=lens
        )
    return _MEASURED[key]


def resolve_shape(options: dict) -> tuple[str, object, tree.TreeShape]:
    """Pop ``shape``, ``gamma`` and the tree options: (shape, gamma, tree shape), where shape is
    "chain", "tree" or "auto" (measure both; a fixed gamma is then the chain candidate) and gamma
    an int or "auto". Without ``shape``: "chain" when gamma is fixed, "tree" when a tree option
    is given, else "auto"."""
    shape = options.pop("shape", None)
    if shape not in (None, *SHAPES):
        raise OptionError(f"shape must be one of {', '.join(map(repr, SHAPES))}, got {shape!r}.")
    gamma = options.pop("gamma", "auto")
    if gamma != "auto":
        gamma = positive_int("gamma", gamma, maximum=64)
    given = sorted(k for k in TREE_OPTIONS if k in options)
    tshape = tree.TreeShape.from_options(options)
    if shape is None:  # not given: a fixed gamma means a chain, a tree option a tree
        shape = "chain" if gamma != "auto" else "tree" if given else "auto"
    if shape == "chain" and given:
        raise OptionError(
            f"{', '.join(given)} shape a tree; pass shape='tree' (or 'auto') to verify trees."
        )
    if shape == "tree" and gamma != "auto":
        raise OptionError(
            "gamma is the length of a chain; with shape='tree' the tree options "
            "(depth, width, branch, bs) set its size."
        )
    return shape, gamma, tshape


def run(target, draft, ids, lens, *, max_new, sampling, eos, seed, prompts, **options):
    reject_unknown("magicdec", options, OPTIONS)
    shape, gamma, tshape = resolve_shape(options)
    d, dparams = resolve_draft(target, draft, **options)
    sp = d.sparse
    top = max(GAMMAS) if gamma == "auto" else gamma
    need = {"chain": top, "tree": tshape.depth, "auto": max(top, tshape.depth)}[shape]
    if sp is not None and sp.window < need + 1:
        raise OptionError(
            f"the draft's recent window ({sp.window}) must hold a whole speculated block "
            f"({need + 1} tokens: gamma + 1 for a chain, depth + 1 for a tree); raise the "
            "budget or the window, or lower gamma or depth."
        )
    extra = {}
    td = tree_draft(d, tshape)
    if shape == "auto" or (shape == "chain" and gamma == "auto"):
        gammas = None if gamma == "auto" else (gamma,)
        m = auto_gamma(target, d, dparams, ids, lens, gammas=gammas)
        tm = auto_tree(target, td, dparams, tshape, ids, lens) if shape == "auto" else None
        shape, gamma, speedup = cost_model.choose_shape(m, tm)
        extra = {
            "predicted_speedup": speedup,
            "cost_model": {
                "t_t_ms": m.t_t,
                "t_d_ms": m.t_d,
                "t_v_ms": dict(m.t_v),
                "alpha": m.alpha,
                "alpha_slowest_row": m.batch_alpha,
                "prefix_bucket": m.prefix,
            },
        }
        if tm is not None:
            extra["cost_model"]["tree"] = {
                "t_e_ms": tm.t_e,
                "t_v_ms": tm.t_v,
                "acceptance_length": tm.acceptance_length,
                "predicted_speedup": 1.0 / tm.relative_time(m.t_t),
            }
    if shape == "tree":
        out, count, stats = _run_tree(
            target, td, dparams, ids, lens, tshape, max_new, sampling, eos, seed
        )
    else:
        out, count, stats = _run_chain(
            target, d, dparams, ids, lens, gamma, max_new, sampling, eos, seed
        )
    stats["shape"] = shape
    stats["budget"] = None if sp is None else sp.budget
    return out, count, {**stats, **extra}


def _run_chain(target, d, dparams, ids, lens, gamma, max_new, sampling, eos, seed):
    out, count, stats = chain.run_resolved(
        target, d, dparams, ids, lens, gamma, max_new, sampling, eos, seed
    )
    stats["alpha"] = cost_model.alpha_from_acceptance_length(stats["acceptance_length"], gamma)
    return out, count, stats


def _run_tree(target, td, dparams, ids, lens, shape, max_new, sampling, eos, seed):
    static = dict(
        graphdef=target.graphdef,
        cfg=target.config,
        draft=td,
        shape=shape,
        max_new=max_new,
        capacity=ids.shape[1] + max_new + shape.capacity + 2,
        sampling=sampling,
        eos=eos,
        chunk=spec_chunk(ids.shape[0]),
    )
    (out, count, steps, emitted, live), wall_s, compile_s = execute(
        tree.decode, target.params, dparams, ids, lens, jax.random.key(seed), **static
    )
    stats = speculative_stats(
        steps, emitted, live, wall_s=wall_s, compile_s=compile_s, draft_per_step=shape.depth
    )
    stats["gamma"] = None
    stats["tree"] = dataclasses.asdict(shape)
    return out, count, stats


def profile(
    target,
    draft,
    batches,
    prefixes,
    *,
    gammas=None,
    tree_shape: tree.TreeShape | None = None,
    prompts=None,
    progress=None,
    **draft_options,
) -> list[dict]:
    """The cost model's table for ``target`` and ``draft`` (``jaxspec profile --method
    magicdec``): for each batch and prefix, measured T_T, T_D, T_V(gamma) and alpha, the
    predicted speedup per gamma, the tree's terms when ``tree_shape`` is given, and the chosen
    shape and gamma. ``prompts(batch, prefix)`` gives the token-id prompts alpha is measured on
    (default: random tokens). ``progress(row)`` is called after each (batch, prefix)."""
    from jaxspec.engines.base import pad_prompts

    gammas = tuple(sorted(set(GAMMAS if gammas is None else gammas)))
    d, dparams = resolve_draft(target, draft, **draft_options)
    need = max(max(gammas), tree_shape.depth if tree_shape else 0)
    if d.sparse is not None and d.sparse.window < need + 1:
        raise OptionError(
            f"the draft's recent window ({d.sparse.window}) must hold {need + 1} tokens "
            "(the largest gamma or the tree depth, plus one); raise the budget or lower them."
        )
    rows = []
    for b in batches:
        for p in prefixes:
            ids = lens = None
            if prompts is not None:
                ids, lens = pad_prompts(prompts(b, p))
            m = cost_model.measure(
                target, d, b, p, gammas, dparams=dparams, ids=ids, lens=lens,
                alpha_gamma=middle(gammas),
            )  # fmt: skip
            tm = None
            if tree_shape is not None:
                tm = cost_model.measure_tree(
                    target, tree_draft(d, tree_shape), tree_shape, b, p, dparams=dparams,
                    ids=ids, lens=lens,
                )  # fmt: skip
            shape, gamma, speedup = cost_model.choose_shape(m, tm)
            row = {
                "batch": b,
                "prefix": p,
                "t_t_ms": m.t_t,
                "t_d_ms": m.t_d,
                "alpha": m.alpha,
                "alpha_slowest_row": m.batch_alpha,
                "t_v_ms": dict(m.t_v),
                "predicted_speedup": {
                    g: 1.0 / cost_model.relative_time(g, m.batch_alpha, m.t_d, m.t_t, m.t_v[g])
                    for g in gammas
                },
                "shape": shape,
                "gamma": gamma,
                "speedup": speedup,
            }
            if tm is not None:
                row["tree"] = {
                    **dataclasses.asdict(tm),
                    "predicted_speedup": 1.0 / tm.relative_time(m.t_t),
                }
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows
