"""MagicDec's cost model (arXiv 2408.11049, section 3): pick gamma for batched speculation.

With acceptance rate alpha, one verification of gamma draft tokens yields on average
Omega(gamma, alpha) = (1 - alpha^(gamma+1)) / (1 - alpha) tokens (gamma + 1 when alpha = 1), and
costs gamma draft steps plus one verify of gamma + 1 tokens, so

    T_SD / T_AR = (gamma * T_D / T_T + T_V(gamma) / T_T) / Omega(gamma, alpha)

where T_T is one autoregressive target step, T_D one draft step and T_V(gamma) one target
verify of gamma + 1 tokens (all at the same batch and context). ``choose_gamma`` minimises it.

Batched trees (beyond MagicDec, which is chain-only): a tree step makes ``depth`` draft
expansions (each one draft forward over the ``width`` best leaves: T_E) and one target verify of
the best ``bs`` nodes plus the root (T_V(bs)), and yields the measured tree acceptance length L
(accepted path plus the bonus token), so

    T_tree / T_AR = (depth * T_E / T_T + T_V(bs) / T_T) / L

``choose_shape`` compares it with the best chain.

A batch decodes until its slowest row is done (every row makes max_new tokens; finished rows
idle), so a batch's time is set by the row that accepts least, not by the mean. MagicDec's alpha
is the mean; the choice here uses the slowest row's (``Measurement.batch_alpha``, from the
per-row acceptance of the same short run; at batch 1 the two agree). On two H200s the mean-alpha
model predicted 1.26x where 0.71x was measured at batch 128, prefix 2K: the loop ran 47 steps
while the mean row needed 27 (benchmarks/RESULTS.md, MagicDec).

Inputs come from ``measure`` / ``measure_tree`` (this machine: the engines' own units, timed by
``measure.units`` at the batch and prefix: the autoregressive engine's decode step for T_T, the
chain engine's propose (gamma = 1) for T_D and its verify for T_V(gamma), the tree engine's grow
(depth = 1) for T_E and its verify for T_V(bs); alpha and L from short runs of those engines)
or from ``analytic_times`` (a machine not at hand: bytes and FLOPs per forward against its
bandwidth and peak). Times are in milliseconds.

long: the model, its two measurements and the tuning that reads and keeps them are one piece;
the formulas are short, and each measurement needs the others' programs and prompts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import jax
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.engines import autoregressive, base, chain, magicdec, tree
from jaxspec.engines.magicdec import alpha_from_acceptance_length, omega
from jaxspec.measure import profiles, units
from jaxspec.model.prefill import pad_prompts
from jaxspec.model.transformer import Model
from jaxspec.spec import tree_drafts
from jaxspec.spec.sampling import Sampling

GREEDY = Sampling()


def relative_time(gamma: int, alpha: float, t_d: float, t_t: float, t_v: float) -> float:
    """T_SD / T_AR for one gamma (``t_v`` is T_V at this gamma)."""
    return (gamma * t_d / t_t + t_v / t_t) / omega(gamma, alpha)


def choose_gamma(
    t_d: float,
    t_t: float,
    t_v: Callable[[int], float] | dict[int, float],
    alpha: float,
    gammas: Iterable[int] | None = None,
) -> tuple[int, float]:
    """The gamma with the smallest T_SD/T_AR and its predicted speedup T_AR/T_SD (ties: the
    smaller gamma). ``gammas`` defaults to the dict's keys, else ``range(1, 9)``."""
    if gammas is None:
        gammas = sorted(t_v) if isinstance(t_v, dict) else range(1, 9)
    tv = t_v.__getitem__ if isinstance(t_v, dict) else t_v
    best = min(gammas, key=lambda g: (relative_time(g, alpha, t_d, t_t, tv(g)), g))
    return best, 1.0 / relative_time(best, alpha, t_d, t_t, tv(best))


def tree_relative_time(depth: int, t_e: float, t_t: float, t_v: float, length: float) -> float:
    """T_tree / T_AR for a tree step: ``depth`` expansions of ``t_e`` ms, a verify of ``t_v``
    ms, ``length`` tokens per verification on average."""
    return (depth * t_e / t_t + t_v / t_t) / max(length, 1e-9)


# ---------------------------------------------------------------------------------------------
# analytic estimate


def param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(all parameters, parameters a token multiplies through: every layer's projections and
    the LM head)."""
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    proj = d * cfg.num_heads * hd * 2 + d * cfg.num_kv_heads * hd * 2 + 3 * d * f
    head = cfg.vocab_size * d
    total = head + cfg.num_layers * (proj + 2 * d) + d + (0 if cfg.tie_word_embeddings else head)
    return total, cfg.num_layers * proj + head


def forward_ms(
    cfg: ModelConfig,
    batch: int,
    tokens: int,
    kv_len: int,
    *,
    hbm_bytes_per_s: float,
    flops_per_s: float,
    dtype_bytes: int = 2,
) -> float:
    """One forward of ``tokens`` tokens per row over ``kv_len`` cached positions:
    max(bytes / bandwidth, FLOPs / peak), bytes = all weights once + every layer's K and V
    (``2 * layers * batch * kv_len * kv_heads * head_dim`` values), FLOPs = 2 per
    multiply-accumulate of the projections and head plus ``4 * layers * batch * tokens * kv_len *
    heads * head_dim`` for QK^T and PV."""
    total, matmul = param_counts(cfg)
    kv = 2 * cfg.num_layers * batch * kv_len * cfg.num_kv_heads * cfg.head_dim
    nbytes = (total + kv) * dtype_bytes
    flops = 2 * batch * tokens * matmul
    flops += 4 * cfg.num_layers * batch * tokens * kv_len * cfg.num_heads * cfg.head_dim
    return max(nbytes / hbm_bytes_per_s, flops / flops_per_s) * 1e3


def analytic_times(
    cfg: ModelConfig,
    batch: int,
    prefix: int,
    budget: int,
    gamma: int,
    hbm_bytes_per_s: float,
    flops_per_s: float,
    *,
    dtype_bytes: int = 2,
    draft_cfg: ModelConfig | None = None,
) -> dict[str, float]:
    """Estimated T_T, T_D, T_V(gamma) in ms: the target over ``prefix`` cached positions (1 and
    gamma + 1 tokens), the draft (``draft_cfg``, default the target itself: self-speculation)
    over its ``budget`` positions (1 token)."""
    hw = dict(hbm_bytes_per_s=hbm_bytes_per_s, flops_per_s=flops_per_s, dtype_bytes=dtype_bytes)
    return {
        "t_t": forward_ms(cfg, batch, 1, prefix, **hw),
        "t_d": forward_ms(draft_cfg or cfg, batch, 1, min(budget, prefix), **hw),
        "t_v": forward_ms(cfg, batch, gamma + 1, prefix, **hw),
    }


# ---------------------------------------------------------------------------------------------
# measurement through the engines' units


@dataclasses.dataclass(frozen=True)
class Measurement:
    batch: int
    prefix: int
    t_t: float  # ms, one autoregressive target step
    t_d: float  # ms, one draft step
    t_v: dict[int, float]  # gamma -> ms, one verify of gamma + 1 tokens
    alpha: float
    alpha_gamma: int
    acceptance_length: float
    slowest_length: float | None = None  # the row that accepted least (None: as the mean)

    @property
    def batch_alpha(self) -> float:
        """The alpha a batch decodes at: its slowest row's (the loop waits for it)."""
        if self.slowest_length is None:
            return self.alpha
        return alpha_from_acceptance_length(self.slowest_length, self.alpha_gamma)

    def choose(self, gammas: Iterable[int] | None = None) -> tuple[int, float]:
        gammas = gammas or sorted(self.t_v)
        return choose_gamma(self.t_d, self.t_t, self.t_v, self.batch_alpha, gammas)


@dataclasses.dataclass(frozen=True)
class TreeMeasurement:
    depth: int
    width: int
    branch: int
    bs: int
    t_e: float  # ms, one draft expansion (a forward over the ``width`` best leaves)
    t_v: float  # ms, one target verify of bs + 1 tree-masked tokens
    acceptance_length: float  # tokens per verification (accepted path + bonus), measured
    slowest_length: float | None = None  # the row that accepted least: the batch waits for it

    def relative_time(self, t_t: float) -> float:
        length = self.acceptance_length if self.slowest_length is None else self.slowest_length
        return tree_relative_time(self.depth, self.t_e, t_t, self.t_v, length)


def slowest_row_length(emitted, live) -> float:
    """Tokens per verification of the row that made fewest (rows that verified at all)."""
    emitted, live = np.asarray(emitted, np.float64), np.asarray(live, np.float64)
    rows = live > 0
    return float((emitted[rows] / live[rows]).min()) if rows.any() else 1.0


def _random_prompts(cfg, batch: int, prefix: int, seed: int):
    rng = np.random.RandomState(seed)
    return (
        rng.randint(0, cfg.vocab_size, (batch, prefix)).astype(np.int32),
        np.full((batch,), prefix, np.int32),
    )


def _request(batch: int, width: int, max_new: int) -> base.Request:
    return base.Request(batch, width, max_new, GREEDY, ())


def _timed(engine, prog, tw, dw, ids, lens, unit: str, reps: int) -> float:
    dflat = None if dw is None else dw.flat
    s = units.initial(engine, prog, tw.flat, dflat, ids, lens)
    u = engine.units(prog)[unit]
    return units.unit_ms(u, prog, tw.flat, dflat, s, reps=reps)


def _short_run(engine, prog, target, dw, ids, lens):
    """A short greedy run's (mean tokens per verification, slowest row's)."""
    out, _, _ = base.on_device(engine.decode, prog, target.weights, dw, ids, lens, 0)
    length = float(np.asarray(out.emitted).sum() / max(np.asarray(out.live_steps).sum(), 1))
    return length, slowest_row_length(out.emitted, out.live_steps)


def _quiet(message: str) -> None:
    pass


_SNAPSHOT = jax.jit(tree.snapshot, static_argnums=1)


def measure(
    target,
    draft,
    batch: int,
    prefix: int,
    gammas: Iterable[int] = magicdec.GAMMAS,
    *,
    options: magicdec.Options | None = None,
    kernels=None,
    ids=None,
    lens=None,
    alpha_gamma: int = 4,
    alpha_tokens: int = 32,
    reps: int = 5,
    seed: int = 0,
    progress=None,
) -> Measurement:
    """T_T, T_D and T_V(gamma) on random prompts of ``batch`` x ``prefix`` through the engines'
    units, and alpha from a short greedy chain run at ``alpha_gamma`` (on ``ids``/``lens`` when
    given, else on the random prompts). ``draft``: what ``generate`` takes for magicdec;
    ``options``: its draft options (budget, sinks, ...); ``progress(message)`` before each part.

    The chain programs of every gamma are built with one cache capacity, so one state (after
    the prefill) serves all their units, and a verify is timed on a proposal of zeros (a greedy
    verify costs the same whatever it is shown): one compile per gamma instead of three."""
    options = options or magicdec.Options(gamma=max(gammas))
    say = progress or _quiet
    d, dw = magicdec.resolve_draft(target, draft, options, kernels)
    gammas = sorted(set(gammas))
    top = max(gammas)
    rand_ids, rand_lens = _random_prompts(target.config, batch, prefix, seed)
    tw = target.weights
    say(f"timing T_T, one target decode step (batch {batch}, {prefix} cached tokens)")
    ar, _ = autoregressive.ENGINE.program(
        target, None, autoregressive.Options(), _request(batch, prefix, 2), kernels
    )
    t_t = _timed(autoregressive.ENGINE, ar, tw, None, rand_ids, rand_lens, "verify", reps)

    def chain_prog(g, r=None):
        r = r or _request(batch, prefix, 2 + top - g)  # the capacity of the largest gamma
        opts = magicdec.chain_options(options, g)
        return chain.ENGINE.program(target, None, opts, r, kernels, resolved=(d, dw))[0]

    dflat = None if dw is None else dw.flat
    first = chain_prog(gammas[0])
    state = units.initial(chain.ENGINE, first, tw.flat, dflat, rand_ids, rand_lens)
    say(f"timing T_D, one {type(d).__name__} draft step")
    propose = chain.ENGINE.units(chain_prog(1))["draft"]
    t_d = units.unit_ms(propose, chain_prog(1), tw.flat, dflat, state, reps=reps)
    t_v = {}
    for g in gammas:
        say(f"timing T_V(gamma={g}), one target verify of {g + 1} tokens")
        prog = chain_prog(g)
        proposal = (np.zeros((batch, g), np.int32), None)
        verify = chain.ENGINE.units(prog)["verify"]
        t_v[g] = units.unit_ms(verify, prog, tw.flat, dflat, state, reps=reps, aux=proposal)
    if ids is None:
        ids, lens = rand_ids, rand_lens
    say(f"measuring alpha: a {alpha_tokens}-token greedy chain run at gamma {alpha_gamma}")
    run_prog = chain_prog(alpha_gamma, _request(ids.shape[0], ids.shape[1], alpha_tokens))
    length, slowest = _short_run(chain.ENGINE, run_prog, target, dw, ids, lens)
    alpha = alpha_from_acceptance_length(length, alpha_gamma)
    return Measurement(batch, prefix, t_t, t_d, t_v, alpha, alpha_gamma, length, slowest)


def measure_tree(
    target,
    draft,
    shape: tree.TreeShape,
    batch: int,
    prefix: int,
    *,
    options: magicdec.Options | None = None,
    kernels=None,
    ids=None,
    lens=None,
    tokens: int = 32,
    reps: int = 5,
    seed: int = 0,
    progress=None,
) -> TreeMeasurement:
    """T_E (the tree engine's grow of one expansion) and T_V(bs) (its verify of the best bs
    nodes) on random prompts of ``batch`` x ``prefix``, and the tree acceptance length from a
    short greedy tree run (on ``ids``/``lens`` when given). The verify is timed on the block of
    the tree before any growth (the same shapes, so the same cost: no compile of a grow)."""
    options = options or magicdec.Options(shape="tree", depth=shape.depth)
    say = progress or _quiet
    d, dw = magicdec.resolve_draft(target, draft, options, kernels)
    rand_ids, rand_lens = _random_prompts(target.config, batch, prefix, seed)
    tw = target.weights

    def tree_prog(sh, r):
        td = tree_drafts.tree_form(d, sh.capacity, sh.depth)
        opts = magicdec.tree_options(dataclasses.replace(options, **dataclasses.asdict(sh)))
        return tree.ENGINE.program(target, None, opts, r, kernels, resolved=(td, dw))[0]

    req = _request(batch, prefix, 2)
    one = dataclasses.replace(shape, depth=1)
    say(f"timing T_E, one expansion of the {shape.width} best leaves")
    t_e = _timed(tree.ENGINE, tree_prog(one, req), tw, dw, rand_ids, rand_lens, "draft", reps)
    say(f"timing T_V(bs={shape.bs}), one target verify of {shape.bs + 1} tree nodes")
    prog, dflat = tree_prog(shape, req), None if dw is None else dw.flat
    state = units.initial(tree.ENGINE, prog, tw.flat, dflat, rand_ids, rand_lens)
    block = _SNAPSHOT(state.draft.tree, shape.bs, state.cache.length, state.cache.length)
    verify = tree.ENGINE.units(prog)["verify"]
    t_v = units.unit_ms(verify, prog, tw.flat, dflat, state, reps=reps, aux=block)
    if ids is None:
        ids, lens = rand_ids, rand_lens
    say(f"measuring the tree's accepted length: a {tokens}-token greedy tree run")
    run_prog = tree_prog(shape, _request(ids.shape[0], ids.shape[1], tokens))
    length, slowest = _short_run(tree.ENGINE, run_prog, target, dw, ids, lens)
    return TreeMeasurement(
        shape.depth, shape.width, shape.branch, shape.bs, t_e, t_v,
        acceptance_length=length, slowest_length=slowest,
    )  # fmt: skip


def choose_shape(
    chain_m: Measurement, tree_m: TreeMeasurement | None = None, gammas=None
) -> tuple[str, int | None, float]:
    """("chain", gamma, speedup) or ("tree", None, speedup): the shape the cost model predicts
    fastest (ties: the chain) and its predicted speedup T_AR / T_SD."""
    gamma, speedup = chain_m.choose(gammas)
    if tree_m is not None:
        tree_speedup = 1.0 / tree_m.relative_time(chain_m.t_t)
        if tree_speedup > speedup:
            return "tree", None, tree_speedup
    return "chain", gamma, speedup


def prefix_bucket(length: int) -> int:
    """Measurements are cached per power-of-two prefix bucket (at least 16)."""
    return max(16, 1 << max(int(length) - 1, 0).bit_length())


def middle(gammas) -> int:
    """The gamma alpha is measured at: the middle of the candidates (alpha, the per-token
    acceptance rate, hardly depends on it)."""
    g = sorted(gammas)
    return g[len(g) // 2]


def tune(
    target, draft, options: magicdec.Options, ids, lens, kernels, progress=None, profile_dir=None
):
    """MagicDec's open choices (``gamma="auto"``, ``shape="auto"``) by the cost model, measured
    once per (draft, batch, prefix bucket) and kept with the draft's model, and in
    ``profile_dir`` when given (``measure.profiles``: a later process on this machine reuses
    it): (options with the chosen shape and gamma, what was chosen and from what)."""
    shape = options.resolved_shape
    if shape == "auto" and options.shape is None and jax.default_backend() != "gpu":
        # on a CPU a shape left open is a chain: measuring the tree too (its grow and verify
        # compiles, a tree run) made a first SmolLM2 run measure for 248 s on 2 loaded cores
        # (benchmarks/results/warm_start_cpu.json); shape="auto" still measures both
        shape = "chain"
    gammas = magicdec.candidate_gammas() if options.gamma == "auto" else (options.gamma,)
    d, _ = magicdec.resolve_draft(target, draft, options, kernels)
    b, bucket = ids.shape[0], prefix_bucket(int(np.max(lens)))
    # kept with the draft's model (the target itself for a self-draft): alpha depends on both
    owner = draft if isinstance(draft, Model) else target
    key = ("magicdec", target.layout, d, b, bucket, gammas)
    described = profiles.describe(target, draft, options, kernels, b, bucket, gammas)
    m = profiles.kept(owner, key, profile_dir, {**described, "kind": "magicdec-chain"}, Measurement)
    if m is None:
        if progress:
            progress(f"measuring MagicDec's cost model (batch {b}, prefix {bucket}): T_T, T_D, "
                     f"T_V for gamma {', '.join(map(str, gammas))}, alpha")  # fmt: skip
        m = measure(
            target, draft, b, bucket, gammas, options=options, kernels=kernels, ids=ids,
            lens=lens, alpha_gamma=middle(gammas), progress=progress,
        )  # fmt: skip
        profiles.keep(owner, key, profile_dir, {**described, "kind": "magicdec-chain"}, m)
    tm = None
    if shape == "auto":
        tkey, tdesc = (*key, "tree", options.tree_shape), {**described, "kind": "magicdec-tree"}
        tdesc["tree"] = dataclasses.asdict(options.tree_shape)
        tm = profiles.kept(owner, tkey, profile_dir, tdesc, TreeMeasurement)
        if tm is None:
            if progress:
                progress("measuring the batched tree: T_E, T_V(bs), its accepted length")
            tm = measure_tree(
                target, draft, options.tree_shape, b, bucket, options=options, kernels=kernels,
                ids=ids, lens=lens, progress=progress,
            )  # fmt: skip
            profiles.keep(owner, tkey, profile_dir, tdesc, tm)
    return _choice(options, m, tm)


def _choice(options: magicdec.Options, m: Measurement, tm: TreeMeasurement | None):
    """(the options with the shape and gamma the cost model picks, the record of the choice)."""
    chosen_shape, gamma, speedup = choose_shape(m, tm)
    cost = dict(
        t_t_ms=m.t_t, t_d_ms=m.t_d, t_v_ms=dict(m.t_v), alpha=m.alpha,
        alpha_slowest_row=m.batch_alpha, prefix_bucket=m.prefix,
    )  # fmt: skip
    if tm is not None:
        cost["tree"] = dict(
            t_e_ms=tm.t_e, t_v_ms=tm.t_v, acceptance_length=tm.acceptance_length,
            predicted_speedup=1.0 / tm.relative_time(m.t_t),
        )  # fmt: skip
    if chosen_shape == "tree":
        new = dataclasses.replace(options, shape="tree", gamma="auto")
    else:
        keep = {k: None for k in ("depth", "width", "branch", "bs")}
        new = dataclasses.replace(options, shape="chain", gamma=gamma, **keep)
    chosen = {
        "chosen": {"shape": chosen_shape, "gamma": gamma},
        "stats": {"predicted_speedup": speedup, "cost_model": cost},
    }
    return new, chosen


def table(
    target,
    draft,
    batches,
    prefixes,
    *,
    gammas=None,
    tree_shape: tree.TreeShape | None = None,
    prompts=None,
    progress=None,
    kernels=None,
    **draft_options,
) -> list[dict]:
    """The cost model's table for ``target`` and ``draft`` (``jaxspec profile --method
    magicdec``): for each batch and prefix, measured T_T, T_D, T_V(gamma) and alpha, the
    predicted speedup per gamma, the tree's terms when ``tree_shape`` is given, and the chosen
    shape and gamma. ``prompts(batch, prefix)`` gives the token-id prompts alpha is measured on
    (default: random tokens). ``progress(row)`` is called after each (batch, prefix)."""
    gammas = tuple(sorted(set(magicdec.GAMMAS if gammas is None else gammas)))
    depth = {} if tree_shape is None else {"shape": "auto", "depth": tree_shape.depth}
    options = magicdec.Options(gamma=max(gammas), **draft_options, **depth)
    if tree_shape is None:
        options = dataclasses.replace(options, shape="chain")
    magicdec.resolve_draft(target, draft, options, kernels)  # the draft's checks, before timing
    rows = []
    for b in batches:
        for p in prefixes:
            ids = lens = None
            if prompts is not None:
                ids, lens = pad_prompts(prompts(b, p), target.net(kernels).kernels)
            m = measure(
                target, draft, b, p, gammas, options=options, kernels=kernels, ids=ids,
                lens=lens, alpha_gamma=middle(gammas),
            )  # fmt: skip
            tm = None
            if tree_shape is not None:
                tm = measure_tree(
                    target, draft, tree_shape, b, p, options=options, kernels=kernels, ids=ids,
                    lens=lens,
                )  # fmt: skip
            shape, gamma, speedup = choose_shape(m, tm)
            row = {
                "batch": b,
                "prefix": p,
                "t_t_ms": m.t_t,
                "t_d_ms": m.t_d,
                "alpha": m.alpha,
                "alpha_slowest_row": m.batch_alpha,
                "t_v_ms": dict(m.t_v),
                "predicted_speedup": {
                    g: 1.0 / relative_time(g, m.batch_alpha, m.t_d, m.t_t, m.t_v[g]) for g in gammas
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
