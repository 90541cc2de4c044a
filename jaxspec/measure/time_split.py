"""The time split of a decode run (``jaxspec bench``): draft, verify, handoff, prefill, host.

The engines run their whole decode loop on device (one jitted ``lax.while_loop``), so no host
timer sees inside it. Instead each component is timed in isolation, with the engine's own pieces
at the run's shapes, and the run's wall time is attributed as count x unit:

- **verify**: one target verify of a block (chain: ``chain.verify``, gamma + 1 tokens and the
  chain rule; tree: ``tree.verify_and_commit``, bs + 1 nodes, the tree rule and the path commit)
  or, for autoregressive, one decode step (``autoregressive.step``), times the loop's steps;
- **draft**: one loop step's draft work (chain: ``draft.propose`` of gamma tokens, i.e. gamma
  forwards of a draft model or the on-device prompt lookup of ngram; tree: ``draft.grow`` of
  depth expansions), times the loop's steps; 0 for autoregressive;
- **handoff**: what the engine measured itself (SwiftSpec's transfers between meshes), else 0;
- **prefill**: the engine's ``init_state`` once (cache allocation, the target's prompt prefill,
  the draft's init or prefill). Not in the four parts the issue names, but it is target work, not
  host overhead, so it gets its own part rather than inflating ``host``;
- **host**: the remainder, wall - the rest: loop control, acceptance bookkeeping outside the timed
  pieces, draft commits, dispatch and the final sync. When the parts exceed the wall (SwiftSpec's
  draft runs while the verify is in flight; timing noise elsewhere) host is clamped at 0 and the
  split says ``host_clamped`` and by how much (``overshoot_s``).

Units are timed with the target cache (and a dense draft's cache) at the run's middle context
(prompt + max_new // 2, where a GPU attention kernel's cost is its mean over the run). A loop
step's pieces run back to back in one on-device loop, state donated, as in the engines
(``cost_model.looped``, ``timing.loop_ms``: 1 and n + 1 steps, the difference over n, so the cost
of a host call cancels out and compilation happens in the untimed warm-up); each keeps what it
computes alive (tokens summed into the state) so XLA can neither drop the LM head nor hoist a
prompt lookup out of the loop. The prefill is one call of the engine's ``init_state``, compiled
ahead of time, on flat parameter leaves. Medians over ``reps``. SwiftSpec's units come from its
own profile (``jaxspec.measure.split``: one verify, one draft expansion; the engine's when it
profiled itself).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from jaxspec.kernels import traced_for_layout
from jaxspec.timing import loop_ms, median_ms

PARTS = ("draft", "verify", "handoff", "prefill", "host")
HOW = (
    "component timings x counts: each piece (one draft step, one target verify or decode step, "
    "one prefill) timed in isolation with the engine's own jitted pieces at the run's shapes "
    "(target cache at prompt + max_new // 2; loop steps back to back on device; compile "
    "excluded; median), multiplied by the "
    "run's counts; handoff as measured by the engine; host = wall - the rest (loop control, "
    "bookkeeping, commits, dispatch), clamped at 0 with host_clamped"
)
METHOD = "component timings x counts"


@dataclasses.dataclass(frozen=True)
class Units:
    """Milliseconds of one of each component at one run shape."""

    rows: int
    prompt_width: int
    context: int  # the target cache length the step pieces were timed at (longest row)
    prefill_ms: float | None  # None: not measured (its time stays in host)
    draft_ms: float  # one loop step's draft work (swiftspec: one expansion)
    verify_ms: float  # one target verify (autoregressive: one decode step)
    draft_unit: str
    verify_unit: str
    measure_s: float  # seconds spent measuring, compiles included (outside every wall)

    def row(self) -> dict:
        return {
            "rows": self.rows,
            "prompt_width": self.prompt_width,
            "context": self.context,
            "prefill_ms": None if self.prefill_ms is None else round(self.prefill_ms, 4),
            "draft_ms": round(self.draft_ms, 4),
            "verify_ms": round(self.verify_ms, 4),
        }


def shape_key(method: str, ids, stats: dict) -> tuple:
    """What the units depend on besides the method's fixed draft and options: the batch shape
    and the shape the engine chose (gamma, tree, device split)."""
    chosen = tuple(
        (k, repr(stats.get(k)))
        for k in ("gamma", "shape", "tree", "depth", "width", "branch", "bs", "target_devices")
    )
    return (method, tuple(ids.shape), chosen)


# ---------------------------------------------------------------------------------------------
# attribution


def attribute(stats: dict, units: Units, method: str) -> dict:
    """Seconds per part of one run from its engine stats and the units at its shape."""
    wall = float(stats["wall_s"])
    if method == "swiftspec":
        draft = stats["draft_expansions"] * units.draft_ms / 1e3
        verify = stats["verify_steps"] * units.verify_ms / 1e3
    else:
        steps = int(stats["target_steps"]) - 1  # loop iterations after the prefill
        draft = 0.0 if method == "autoregressive" else steps * units.draft_ms / 1e3
        verify = steps * units.verify_ms / 1e3
    handoff = float(stats.get("handoff_s", 0.0))
    prefill = (units.prefill_ms or 0.0) / 1e3
    host = wall - draft - verify - handoff - prefill
    out = {"draft_s": draft, "verify_s": verify, "handoff_s": handoff, "prefill_s": prefill}
    out.update(host_s=max(host, 0.0), wall_s=wall, host_clamped=host < 0)
    if host < 0:
        out["overshoot_s"] = -host
    return out


def fractions(split: dict) -> dict:
    """Each part's share of the parts' sum (the wall, unless host was clamped)."""
    total = sum(split[f"{p}_s"] for p in PARTS)
    return {p: round(split[f"{p}_s"] / total, 4) if total > 0 else 0.0 for p in PARTS}


def summarize(splits: list[dict], units: list[Units], counts: dict) -> dict:
    """A method's split over its runs: summed seconds, shares, the units and counts used."""
    total = {f"{p}_s": sum(s[f"{p}_s"] for s in splits) for p in PARTS}
    total["wall_s"] = sum(s["wall_s"] for s in splits)
    out = {k: round(v, 6) for k, v in total.items()}
    out["fractions"] = fractions(total)
    out["host_clamped"] = any(s["host_clamped"] for s in splits)
    if out["host_clamped"]:
        out["overshoot_s"] = round(sum(s.get("overshoot_s", 0.0) for s in splits), 6)
    seen = list({id(u): u for u in units}.values())  # each shape's units once

    def named(field):  # one name, or each distinct one (MagicDec may pick per batch)
        names = list(dict.fromkeys(getattr(u, field) for u in seen))
        return " | ".join(names) if names else None

    out.update(
        method=METHOD,
        draft_unit=named("draft_unit"),
        verify_unit=named("verify_unit"),
        prefill_measured=all(u.prefill_ms is not None for u in seen),
        units_ms=[u.row() for u in seen],
        counts=counts,
        measure_s=round(sum(u.measure_s for u in seen), 3),
        how=HOW,
    )
    return out


# ---------------------------------------------------------------------------------------------
# the timed pieces: the engines' own functions. Loop steps run back to back in one on-device loop
# (cost_model.looped, timing.loop_ms: the per-call cost of a host dispatch cancels out), the
# prefill is one call of an ahead-of-time compiled executable on flat parameter leaves.


def _aot(fn, *args, **static):
    """Compile ``fn`` for these arguments (not timed); returns the executable, which takes the
    non-static arguments only."""
    return fn.lower(*args, **static).compile()


def _tree(ptree, flat):
    return jax.tree.unflatten(ptree, flat)


@functools.partial(
    jax.jit, static_argnames=("ptree", "graphdef", "cfg", "max_new", "capacity", "sampling", "eos")
)
def _ar_init(tflat, ids, lens, key, *, ptree, graphdef, cfg, max_new, capacity, sampling, eos):
    from jaxspec.engines import autoregressive

    return autoregressive.init_state(
        graphdef,
        _tree(ptree, tflat),
        ids,
        lens,
        key,
        cfg=cfg,
        max_new=max_new,
        capacity=capacity,
        sampling=sampling,
        eos=eos,
    )


_SPEC_INIT = ("tptree", "dptree", "graphdef", "cfg", "draft", "max_new", "capacity", "sampling")


@functools.partial(jax.jit, static_argnames=(*_SPEC_INIT, "room", "eos"))
def _chain_init(tflat, dflat, ids, lens, key, *, tptree, dptree, **static):
    from jaxspec.engines import chain

    return chain.init_state(_tree(tptree, tflat), _tree(dptree, dflat), ids, lens, key, **static)


@functools.partial(jax.jit, static_argnames=(*_SPEC_INIT, "eos"))
def _tree_init(tflat, dflat, ids, lens, key, *, tptree, dptree, **static):
    from jaxspec.engines import tree

    return tree.init_state(_tree(tptree, tflat), _tree(dptree, dflat), ids, lens, key, **static)


def _loop_ms(run, state, *args, reps: int) -> float:
    """``timing.loop_ms`` with enough steps that the timed difference stands above the timer's
    noise: 8 steps, then as many as ~50 ms of them take when 8 were quicker (a prompt lookup
    costs microseconds)."""
    t = loop_ms(run, state, *args, reps=reps)
    if t * 8 < 50.0:
        n = min(4096, max(8, int(50.0 / max(t, 0.01))))
        t = loop_ms(run, state, *args, n=n, reps=reps)
    return t


def _prefill_ms(init, args, reps: int) -> float:
    return median_ms(lambda: init(*args), reps)


def _keep_alive(dstate, acc):
    """Make a prompt-lookup state depend on the step's output: its lookup reads a state the step
    hands back unchanged, which the compiler would otherwise hoist out of the timing loop (timed
    as nothing). The value lands in the history's last slot, past every row's length until the
    very end, so the lookup itself is unchanged."""
    from jaxspec.spec.drafts import NgramState
    from jaxspec.spec.tree_drafts import NgramTreeState

    if isinstance(dstate, NgramState):
        return NgramState(dstate.hist.at[:, -1].set(acc), dstate.hlen)
    if isinstance(dstate, NgramTreeState):
        return NgramTreeState(_keep_alive(dstate.lookup, acc), dstate.tree)
    return dstate


def propose_step(st, dparams, key, *, draft, gamma, sampling):
    """One chain step's draft work: ``propose`` of gamma tokens; ``st = (draft state, sum)``."""
    dstate, acc = st
    x, q, dstate = draft.propose(dparams, dstate, key, gamma, sampling)
    acc = acc + x.sum(1) + q.sum((1, 2)).astype(acc.dtype)
    return _keep_alive(dstate, acc), acc


def grow_step(dstate, dparams, *, draft, depth, width, branch):
    """One tree step's draft work: ``grow`` of depth expansions."""
    dstate = draft.grow(dparams, dstate, expansions=depth, width=width, branch=branch)
    return _keep_alive(dstate, dstate.tree.token.sum(1))


def _advance(cache, k: int):
    return dataclasses.replace(cache, length=cache.length + k)


def _advance_draft(dstate, sparse, k: int):
    """A dense model draft's cache moved to the same context as the target's (sparse caches
    have a fixed budget; prompt lookup costs the same at any length)."""
    if sparse is None and hasattr(dstate, "cache") and hasattr(dstate, "seen"):
        return dataclasses.replace(dstate, cache=_advance(dstate.cache, k), seen=dstate.seen + k)
    return dstate


def _context(lens, shift: int) -> int:
    return int(lens.max()) + shift


# ---------------------------------------------------------------------------------------------
# per engine


@traced_for_layout
def measure(target, method, draft, ids, lens, stats, *, max_new, options, sampling, reps=3):
    """The units of ``method`` at this run's shapes (``ids``/``lens``: the padded batch the
    engine ran; ``stats``: its stats, for the shape it chose). ``reps``: timed repetitions of
    each piece (medians)."""
    from jaxspec.engines.tree import TreeShape

    t0 = time.perf_counter()
    shift = max_new // 2
    eos = tuple(target.config.eos_token_ids)
    common = dict(max_new=max_new, sampling=sampling, eos=eos, shift=shift, reps=reps)
    pick = lambda *names: {k: options[k] for k in names if k in options}  # noqa: E731
    if method == "autoregressive":
        u = _autoregressive(target, ids, lens, **common)
    elif method == "chain":
        from jaxspec.spec import drafts

        d, dparams = drafts.resolve(target, draft, "chain", **pick("budget", "sinks", "ngram"))
        u = _chain(target, d, dparams, ids, lens, stats["gamma"], **common)
    elif method == "tree":
        from jaxspec.spec import tree_drafts

        shape = TreeShape(**{k: stats[k] for k in ("depth", "width", "branch", "bs")})
        extra = pick("budget", "sinks", "ngram")
        d, dparams = tree_drafts.resolve(target, draft, capacity=shape.capacity, **extra)
        u = _tree_units(target, d, dparams, ids, lens, shape, **common)
    elif method == "magicdec":
        from jaxspec.engines import magicdec

        rest = dict(options)
        magicdec.resolve_shape(rest)  # drops the shape options; the rest shape the draft
        d, dparams = magicdec.resolve_draft(target, draft, **rest)
        if stats.get("shape") == "tree":
            shape = TreeShape(**stats["tree"])
            td = magicdec.tree_draft(d, shape)
            u = _tree_units(target, td, dparams, ids, lens, shape, **common)
        else:
            u = _chain(target, d, dparams, ids, lens, stats["gamma"], **common)
    elif method == "swiftspec":
        u = _swiftspec(target, draft, ids, lens, stats, reps=reps)
    else:
        raise ValueError(f"no time split for method {method!r}")
    return dataclasses.replace(
        u, rows=ids.shape[0], prompt_width=ids.shape[1], measure_s=time.perf_counter() - t0
    )


def _units(**kw) -> Units:
    return Units(rows=0, prompt_width=0, measure_s=0.0, **kw)


def _autoregressive(target, ids, lens, *, max_new, sampling, eos, shift, reps):
    from jaxspec.measure.cost_model import ar_step, looped

    tflat, tptree = jax.tree.flatten(target.params)
    args = (tflat, ids, lens, jax.random.key(0))
    init = _aot(
        _ar_init,
        *args,
        ptree=tptree,
        graphdef=target.graphdef,
        cfg=target.config,
        max_new=max_new,
        capacity=ids.shape[1] + max_new,  # as autoregressive.run
        sampling=sampling,
        eos=eos,
    )
    prefill = _prefill_ms(init, args, reps)
    s = init(*args)
    s = dataclasses.replace(s, cache=_advance(s.cache, shift))
    run = looped(ar_step, graphdef=target.graphdef, sampling=sampling)
    return _units(
        context=_context(lens, shift),
        prefill_ms=prefill,
        draft_ms=0.0,
        verify_ms=_loop_ms(run, s, target.params, reps=reps),
        draft_unit="none",
        verify_unit="one target decode step (autoregressive.step)",
    )


def _chain(target, d, dparams, ids, lens, gamma, *, max_new, sampling, eos, shift, reps):
    from jaxspec.measure.cost_model import looped, verify_step

    tflat, tptree = jax.tree.flatten(target.params)
    dflat, dptree = jax.tree.flatten(dparams)
    key = jax.random.key(0)
    args = (tflat, dflat, ids, lens, key)
    init = _aot(
        _chain_init,
        *args,
        tptree=tptree,
        dptree=dptree,
        graphdef=target.graphdef,
        cfg=target.config,
        draft=d,
        max_new=max_new,
        capacity=ids.shape[1] + max_new + gamma + 2,  # as chain.run_resolved
        room=gamma + 2,
        sampling=sampling,
        eos=eos,
    )
    prefill = _prefill_ms(init, args, reps)
    s = init(*args)
    cache = _advance(s.cache, shift)
    dstate = _advance_draft(s.draft, getattr(d, "sparse", None), shift)
    zero = jnp.zeros((ids.shape[0],), jnp.int32)
    t_draft = _loop_ms(
        looped(propose_step, draft=d, gamma=gamma, sampling=sampling),
        (dstate, zero),
        dparams,
        key,
        reps=reps,
    )
    proposal = jax.jit(lambda dp, ds, k: d.propose(dp, ds, k, gamma, sampling)[:2])
    x, q = proposal(dparams, jax.tree.map(jnp.copy, dstate), key)  # what the verify checks
    t_verify = _loop_ms(
        looped(verify_step, graphdef=target.graphdef, sampling=sampling),
        (cache, zero),
        target.params,
        s.token,
        x,
        q,
        key,
        reps=reps,
    )
    kind = type(d).__name__
    return _units(
        context=_context(lens, shift),
        prefill_ms=prefill,
        draft_ms=t_draft,
        verify_ms=t_verify,
        draft_unit=f"one propose of gamma={gamma} tokens ({kind}.propose)",
        verify_unit=f"one target verify of gamma + 1 = {gamma + 1} tokens (chain.verify)",
    )


def _tree_units(target, d, dparams, ids, lens, shape, *, max_new, sampling, eos, shift, reps):
    from jaxspec.measure.cost_model import looped, tree_verify_step
    from jaxspec.spec import tree as T

    tflat, tptree = jax.tree.flatten(target.params)
    dflat, dptree = jax.tree.flatten(dparams)
    key = jax.random.key(0)
    args = (tflat, dflat, ids, lens, key)
    init = _aot(
        _tree_init,
        *args,
        tptree=tptree,
        dptree=dptree,
        graphdef=target.graphdef,
        cfg=target.config,
        draft=d,
        max_new=max_new,
        capacity=ids.shape[1] + max_new + shape.capacity + 2,  # as engines.tree.run
        sampling=sampling,
        eos=eos,
    )
    prefill = _prefill_ms(init, args, reps)
    s = init(*args)
    cache = _advance(s.cache, shift)
    dstate = _advance_draft(s.draft, getattr(d, "sparse", None), shift)
    dims = dict(depth=shape.depth, width=shape.width, branch=shape.branch)
    t_draft = _loop_ms(looped(grow_step, draft=d, **dims), dstate, dparams, reps=reps)
    grown = jax.jit(grow_step, static_argnames=("draft", "depth", "width", "branch"))(
        jax.tree.map(jnp.copy, dstate), dparams, draft=d, **dims
    )
    idx, cnt = T.select_subtree(grown.tree, shape.bs)
    tb = T.verify_layout(grown.tree, idx, cnt, cache.length, cache.length)
    t_verify = _loop_ms(
        looped(tree_verify_step, graphdef=target.graphdef, sampling=sampling, eos=eos),
        cache,
        target.params,
        tb,
        key,
        s.out,
        s.count,
        s.done,
        reps=reps,
    )
    kind = type(d).__name__
    return _units(
        context=_context(lens, shift),
        prefill_ms=prefill,
        draft_ms=t_draft,
        verify_ms=t_verify,
        draft_unit=f"one grow of depth={shape.depth} expansions ({kind}.grow)",
        verify_unit=f"one target verify of bs + 1 = {shape.bs + 1} tree nodes "
        "(tree.verify_and_commit)",
    )


def _swiftspec(target, draft, ids, lens, stats, *, reps):
    """SwiftSpec's own profile: the engine's when it profiled itself, else one for this split."""
    p = stats.get("profiled")
    if p is None:
        from jaxspec.measure import split as profiler

        prompt = [int(t) for t in ids[0, : int(lens[0])]]
        split = (stats["target_devices"], stats["draft_devices"])
        prof = profiler.measure(
            target,
            draft,
            prompt,
            split,
            width=stats["width"],
            branch=stats["branch"],
            bs=stats["bs"],
            reps=reps,
        )
        p = dataclasses.asdict(prof)
    return _units(
        context=int(lens.max()),
        prefill_ms=None,
        draft_ms=p["t_draft_ms"],
        verify_ms=p["t_verify_ms"],
        draft_unit="one draft expansion (profiler: swiftspec.draft_grow, n=1)",
        verify_unit="one target verify of the bs-node snapshot (profiler: swiftspec.target_verify)",
    )


__all__ = [
    "HOW",
    "METHOD",
    "PARTS",
    "Units",
    "attribute",
    "fractions",
    "measure",
    "shape_key",
    "summarize",
]
