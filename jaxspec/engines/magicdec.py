"""MagicDec (arXiv 2408.11049): batched long-context speculation with a sparse-KV draft.

The draft's KV cache has a fixed budget, so its step costs about the same at any context while
the target's grows with it: past a critical length, speculation pays off even at large batch.
Drafts: ``"self-streaming"`` (the target with a StreamingLLM cache: ``sinks`` first tokens plus a
ring of the recent ``window``), ``"self-snapkv"`` (the target with a SnapKV cache: positions the
last ``obs`` prompt queries attend to most plus the recent ``window``), or a small draft Model
with either cache (``sparse="streaming" | "snapkv"``; ``"dense"`` keeps its full cache).

The decoding loop is the chain engine's (``chain.decode``: the whole loop on device, ragged
per-row acceptance, EOS per row); this module picks the draft and gamma. ``gamma="auto"`` (the
default) measures T_T, T_D, T_V(gamma) and alpha on this machine (jaxspec.cost_model) once per
(models, batch, prefix bucket) and takes the gamma the cost model predicts fastest.
"""

from __future__ import annotations

import jax

from jaxspec import cost_model, drafts
from jaxspec.engines import chain
from jaxspec.engines.common import execute, speculative_stats
from jaxspec.engines.options import positive_int, reject_unknown
from jaxspec.errors import DraftError, OptionError

OPTIONS = ("gamma", "budget", "sinks", "window", "obs", "pool", "sparse")
GAMMAS = range(1, 9)

_MEASURED: dict = {}


def resolve_draft(target, draft, *, sparse=None, **budget):
    """(draft object, its params) for MagicDec: a sparse-KV self draft, or a draft Model with a
    sparse (default "streaming") or "dense" cache."""
    from jaxspec.model import Model

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


def auto_gamma(target, d, dparams, ids, lens, *, gammas=None) -> cost_model.Measurement:
    """The cost model's measurement for this (target, draft, batch, prefix bucket), cached."""
    gammas = tuple(GAMMAS if gammas is None else gammas)
    b = ids.shape[0]
    bucket = cost_model.prefix_bucket(int(lens.max()))
    key = (target.config, target.graphdef, d, b, bucket, gammas)
    if key not in _MEASURED:
        _MEASURED[key] = cost_model.measure(
            target, d, b, bucket, gammas, dparams=dparams, ids=ids, lens=lens
        )
    return _MEASURED[key]


def run(target, draft, ids, lens, *, max_new, sampling, eos, seed, prompts, **options):
    reject_unknown("magicdec", options, OPTIONS)
    gamma = options.pop("gamma", "auto")
    if gamma != "auto":
        gamma = positive_int("gamma", gamma, maximum=64)
    d, dparams = resolve_draft(target, draft, **options)
    sp = d.sparse
    top = max(GAMMAS) if gamma == "auto" else gamma
    if sp is not None and sp.window < top + 1:
        raise OptionError(
            f"the draft's recent window ({sp.window}) must hold a whole speculated block "
            f"(gamma + 1 = {top + 1} tokens); raise the budget or the window, or lower gamma."
        )
    extra = {}
    if gamma == "auto":
        m = auto_gamma(target, d, dparams, ids, lens)
        gamma, speedup = m.choose()
        extra = {
            "predicted_speedup": speedup,
            "cost_model": {
                "t_t_ms": m.t_t,
                "t_d_ms": m.t_d,
                "t_v_ms": dict(m.t_v),
                "alpha": m.alpha,
                "prefix_bucket": m.prefix,
            },
        }
    static = dict(
        graphdef=target.graphdef,
        cfg=target.config,
        draft=d,
        gamma=gamma,
        max_new=max_new,
        capacity=ids.shape[1] + max_new + gamma + 2,
        sampling=sampling,
        eos=eos,
    )
    (out, count, steps, emitted, live), wall_s, compile_s = execute(
        chain.decode, target.params, dparams, ids, lens, jax.random.key(seed), **static
    )
    stats = speculative_stats(
        steps, emitted, live, wall_s=wall_s, compile_s=compile_s, draft_per_step=gamma
    )
    stats["gamma"] = gamma
    stats["alpha"] = cost_model.alpha_from_acceptance_length(stats["acceptance_length"], gamma)
    stats["budget"] = None if sp is None else sp.budget
    return out, count, {**stats, **extra}
