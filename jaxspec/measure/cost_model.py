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

``choose_shape`` compares it with the best chain. ``measure_tree`` measures T_E, T_V(bs) and L
with the tree engine's own pieces.

A batch decodes until its slowest row is done (every row makes max_new tokens; finished rows
idle), so a batch's time is set by the row that accepts least, not by the mean. MagicDec's alpha
is the mean; the choice here uses the slowest row's (``Measurement.batch_alpha``, from the
per-row acceptance of the same short run; at batch 1 the two agree). On two H200s the mean-alpha
model predicted 1.26x where 0.71x was measured at batch 128, prefix 2K: the loop ran 47 steps
while the mean row needed 27 (``benchmarks/notes/magicdec.md``).

Inputs come from ``measure`` (this machine: the engines' own pieces on random prompts of the
batch and prefix, each timed back to back in an on-device loop as the engines run them; alpha
from a short chain run) or from ``analytic_times`` (a machine not at hand: bytes and FLOPs per
forward against its bandwidth and peak). Times are in milliseconds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.kernels import traced_for_layout
from jaxspec.timing import loop_ms, repeat


def omega(gamma: int, alpha: float) -> float:
    """Expected tokens per verification: (1 - alpha^(gamma+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


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


def alpha_from_acceptance_length(length: float, gamma: int) -> float:
    """The alpha whose Omega(gamma, alpha) equals a measured acceptance length (tokens per
    verification), by bisection; clipped to [0, 1]."""
    if length >= gamma + 1:
        return 1.0
    if length <= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if omega(gamma, mid) < length else (lo, mid)
    return (lo + hi) / 2


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
# measurement


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


def slowest_row_length(emitted, live) -> float:
    """Tokens per verification of the row that made fewest (rows that verified at all)."""
    emitted, live = np.asarray(emitted, np.float64), np.asarray(live, np.float64)
    rows = live > 0
    return float((emitted[rows] / live[rows]).min()) if rows.any() else 1.0


# The timed steps: ``looped(step, **static)`` runs k of them in one on-device loop
# (timing.repeat; timing.loop_ms times it), the state donated as in the engines' loops, so a
# timing counts neither a copy of the cache nor the ~1 ms a single host call of a small model
# costs besides its device work. Lengths are kept, so steps repeat; the tokens are summed into
# the state so that the LM head and the sampling stay in the program.


def verify_step(st, tparams, token, x, q, key, *, graphdef, sampling):
    """T_V: the chain engine's own verify (the target over gamma + 1 tokens, then the rule);
    ``st = (cache, token sum)``."""
    from jaxspec.engines.chain import verify

    cache, acc = st
    n, nxt, cache = verify(tparams, cache, token, x, q, key, graphdef=graphdef, sampling=sampling)
    return cache, acc + n + nxt


def ar_step(s, tparams, *, graphdef, sampling):
    """T_T: one autoregressive step (``autoregressive.State``)."""
    from jaxspec.engines import autoregressive

    out = autoregressive.step(graphdef, tparams, s, sampling=sampling, eos=())
    out.cache.length = s.cache.length
    return out


def draft_step(st, dparams, key, *, draft, sampling):
    """T_D: one draft forward (``propose`` with gamma = 1); ``st = (draft state, token sum)``."""
    dstate, acc = st
    x, _, dstate = draft.propose(dparams, dstate, key, 1, sampling)
    return dstate, acc + x[:, 0]


@functools.cache
def looped(step, **static):
    """The jitted ``timing.repeat`` of ``step`` with its static arguments (one per pair)."""
    return jax.jit(repeat(functools.partial(step, **static)), donate_argnums=(0,))


@traced_for_layout
def measure(
    target,
    draft,
    batch: int,
    prefix: int,
    gammas: Iterable[int] = range(1, 9),
    *,
    dparams=None,
    ids=None,
    lens=None,
    alpha_gamma: int = 4,
    alpha_tokens: int = 32,
    reps: int = 5,
    seed: int = 0,
) -> Measurement:
    """Time T_T, T_D and T_V(gamma) on random prompts of ``batch`` x ``prefix`` with the engines'
    own pieces (autoregressive.step, the draft's propose, the chain verify), and alpha from a
    short greedy chain run at ``alpha_gamma`` (on ``ids``/``lens`` when given, else on the
    random prompts).

    ``draft``: a resolved draft object with ``dparams``, or anything ``drafts.resolve`` takes."""
    from jaxspec.engines import autoregressive, chain
    from jaxspec.engines.base import execute
    from jaxspec.spec import drafts
    from jaxspec.spec.sampling import Sampling

    if not hasattr(draft, "propose"):
        draft, dparams = drafts.resolve(target, draft, "magicdec")
    gammas = sorted(set(gammas))
    cfg, graphdef, tparams = target.config, target.graphdef, target.params
    greedy = Sampling(0.0, 1.0, 0)
    rng = np.random.RandomState(seed)
    rand_ids = jnp.asarray(rng.randint(0, cfg.vocab_size, (batch, prefix)), jnp.int32)
    rand_lens = jnp.full((batch,), prefix, jnp.int32)
    top = max(gammas)
    capacity = prefix + top + 2
    init = jax.jit(
        chain.init_state,
        static_argnames=(
            "graphdef",
            "cfg",
            "draft",
            "max_new",
            "capacity",
            "room",
            "sampling",
            "eos",
        ),
    )
    s = init(
        tparams,
        dparams,
        rand_ids,
        rand_lens,
        jax.random.key(seed),
        graphdef=graphdef,
        cfg=cfg,
        draft=draft,
        max_new=2,
        capacity=capacity,
        room=top + 2,
        sampling=greedy,
        eos=(),
    )
    key = jax.random.key(seed + 1)

    # T_T: one autoregressive step
    ar = autoregressive.State(
        s.cache,
        s.token,
        jnp.zeros((batch, 2), jnp.int32),
        jnp.ones((batch,), jnp.int32),
        jnp.zeros((batch,), bool),
        jnp.zeros((), jnp.int32),
        key,
    )
    t_t = loop_ms(looped(ar_step, graphdef=graphdef, sampling=greedy), ar, tparams, reps=reps)

    # T_D: one draft step (propose with gamma = 1 is exactly one draft forward)
    zero = jnp.zeros((batch,), jnp.int32)
    run = looped(draft_step, draft=draft, sampling=greedy)
    t_d = loop_ms(run, (s.draft, zero), dparams, key, reps=reps)

    # T_V(gamma): one verify of gamma + 1 tokens
    t_v = {}
    run = looped(verify_step, graphdef=graphdef, sampling=greedy)
    for g in gammas:
        x = jnp.asarray(rng.randint(0, cfg.vocab_size, (batch, g)), jnp.int32)
        q = jax.nn.one_hot(x, cfg.vocab_size, dtype=jnp.float32)
        t_v[g] = loop_ms(run, (s.cache, zero), tparams, s.token, x, q, key, reps=reps)

    # alpha: a short greedy chain run
    if ids is None:
        ids, lens = rand_ids, rand_lens
    (_, _, _, emitted, live), _, _ = execute(
        chain.decode,
        tparams,
        dparams,
        ids,
        lens,
        jax.random.key(seed),
        graphdef=graphdef,
        cfg=cfg,
        draft=draft,
        gamma=alpha_gamma,
        max_new=alpha_tokens,
        capacity=ids.shape[1] + alpha_tokens + alpha_gamma + 2,
        sampling=greedy,
        eos=(),
    )
    length = float(np.asarray(emitted).sum() / max(np.asarray(live).sum(), 1))
    return Measurement(
        batch=batch,
        prefix=prefix,
        t_t=t_t,
        t_d=t_d,
        t_v=t_v,
        alpha=alpha_from_acceptance_length(length, alpha_gamma),
        alpha_gamma=alpha_gamma,
        acceptance_length=length,
        slowest_length=slowest_row_length(emitted, live),
    )


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


def choose_shape(
    chain: Measurement, tree: TreeMeasurement | None = None, gammas: Iterable[int] | None = None
) -> tuple[str, int | None, float]:
    """("chain", gamma, speedup) or ("tree", None, speedup): the shape the cost model predicts
    fastest (ties: the chain) and its predicted speedup T_AR / T_SD."""
    gamma, speedup = chain.choose(gammas)
    if tree is not None:
        tree_speedup = 1.0 / tree.relative_time(chain.t_t)
        if tree_speedup > speedup:
            return "tree", None, tree_speedup
    return "chain", gamma, speedup


def tree_verify_step(cache, tparams, tb, key, out, count, done, *, graphdef, sampling, eos):
    """T_V(bs) of a tree: the tree engine's verify of a laid-out block, then its commit."""
    from jaxspec.engines.tree import verify_and_commit

    v = verify_and_commit(
        tparams, cache, tb, key, out, count, done, graphdef=graphdef, sampling=sampling, eos=eos
    )
    v.cache.length = cache.length
    return v.cache


def grow_step(dstate, dparams, *, draft, width, branch):
    """T_E: one expansion of a tree draft."""
    return draft.grow(dparams, dstate, expansions=1, width=width, branch=branch)


@traced_for_layout
def measure_tree(
    target,
    draft,
    shape,
    batch: int,
    prefix: int,
    *,
    dparams,
    ids=None,
    lens=None,
    tokens: int = 32,
    reps: int = 5,
    seed: int = 0,
) -> TreeMeasurement:
    """Time one draft expansion (T_E) and one target verify of the ``shape.bs`` best nodes
    (T_V(bs)) on random prompts of ``batch`` x ``prefix`` with the tree engine's own pieces, and
    the tree acceptance length from a short greedy tree run (on ``ids``/``lens`` when given).

    ``draft``: a tree draft (``tree_drafts.ModelTreeDraft``) with ``dparams``; ``shape``: a
    ``engines.tree.TreeShape``."""
    from jaxspec.engines import tree as tree_engine
    from jaxspec.engines.base import execute
    from jaxspec.spec import tree as T
    from jaxspec.spec.sampling import Sampling

    cfg, graphdef, tparams = target.config, target.graphdef, target.params
    greedy = Sampling(0.0, 1.0, 0)
    rng = np.random.RandomState(seed)
    rand_ids = jnp.asarray(rng.randint(0, cfg.vocab_size, (batch, prefix)), jnp.int32)
    rand_lens = jnp.full((batch,), prefix, jnp.int32)
    init = jax.jit(
        tree_engine.init_state,
        static_argnames=("graphdef", "cfg", "draft", "max_new", "capacity", "sampling", "eos"),
    )
    s = init(
        tparams,
        dparams,
        rand_ids,
        rand_lens,
        jax.random.key(seed),
        graphdef=graphdef,
        cfg=cfg,
        draft=draft,
        max_new=2,
        capacity=prefix + shape.capacity + 2,
        sampling=greedy,
        eos=(),
    )
    grow = jax.jit(draft.grow, static_argnames=("expansions", "width", "branch"))
    dims = dict(width=shape.width, branch=shape.branch)
    grown = grow(dparams, s.draft, expansions=shape.depth, **dims)
    t_e = loop_ms(looped(grow_step, draft=draft, **dims), s.draft, dparams, reps=reps)
    idx, cnt = T.select_subtree(grown.tree, shape.bs)
    tb = T.verify_layout(grown.tree, idx, cnt, s.cache.length, s.cache.length)
    key = jax.random.key(seed + 1)
    run = looped(tree_verify_step, graphdef=graphdef, sampling=greedy, eos=())
    t_v = loop_ms(run, s.cache, tparams, tb, key, s.out, s.count, s.done, reps=reps)
    if ids is None:
        ids, lens = rand_ids, rand_lens
    (_, _, _, emitted, live), _, _ = execute(
        tree_engine.decode,
        tparams,
        dparams,
        ids,
        lens,
        jax.random.key(seed),
        graphdef=graphdef,
        cfg=cfg,
        draft=draft,
        shape=shape,
        max_new=tokens,
        capacity=ids.shape[1] + tokens + shape.capacity + 2,
        sampling=greedy,
        eos=(),
    )
    length = float(np.asarray(emitted).sum() / max(np.asarray(live).sum(), 1))
    return TreeMeasurement(
        shape.depth,
        shape.width,
        shape.branch,
        shape.bs,
        t_e,
        t_v,
        acceptance_length=length,
        slowest_length=slowest_row_length(emitted, live),
    )


def prefix_bucket(length: int) -> int:
    """Measurements are cached per power-of-two prefix bucket (at least 16)."""
    return max(16, 1 << max(int(length) - 1, 0).bit_length())


__all__ = [
    "Measurement",
    "TreeMeasurement",
    "alpha_from_acceptance_length",
    "analytic_times",
    "ar_step",
    "choose_gamma",
    "choose_shape",
    "draft_step",
    "forward_ms",
    "grow_step",
    "looped",
    "measure",
    "measure_tree",
    "omega",
    "param_counts",
    "prefix_bucket",
    "relative_time",
    "tree_relative_time",
    "tree_verify_step",
    "verify_step",
]
