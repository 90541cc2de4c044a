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
import os
import statistics
import time
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.engines import autoregressive, base, chain, magicdec, programs, tree
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
    t_t: float | None  # ms, one autoregressive target step (None: not timed, ``Plan.t_t``)
    t_d: float | None  # ms, one draft step (None: units not timed, ``Plan.units_if_they_pay``)
    t_v: dict[int, float]  # gamma -> ms, one verify of gamma + 1 tokens (empty: not timed)
    alpha: float
    alpha_gamma: int
    acceptance_length: float
    slowest_length: float | None = None  # the row that accepted least (None: as the mean)
    interpolated: tuple[int, ...] = ()  # gammas whose T_V was not timed (``Plan.timed``)
    # seconds the measuring call's own loop at alpha_gamma took to compile, in whichever call of
    # this process compiled it (``programs.built_seconds``: the alpha run's programs; None: the
    # alpha run had programs of its own)
    loop_compile_s: float | None = None
    # ms a token of the measuring call's own loop at alpha_gamma, as its alpha run went (its
    # wall over its iterations, over the slowest row's tokens an iteration); None: not timed
    own_token_ms: float | None = None

    @property
    def timed_units(self) -> bool:
        """Whether T_D and T_V were timed (else only alpha and the call's own loop were)."""
        return self.t_d is not None

    def settles(self, tokens: int | None) -> bool:
        """Whether a call of ``tokens`` new tokens runs at ``alpha_gamma`` whatever T_D and T_V
        are: it would take ``own_token_ms`` a token there, and no gamma can save more than all
        of that, which is no more than compiling another gamma's loop costs
        (``loop_compile_s``, the seconds ``alpha_gamma``'s took)."""
        if tokens is None or self.own_token_ms is None or self.loop_compile_s is None:
            return False
        return tokens * self.own_token_ms / 1e3 <= self.loop_compile_s

    @property
    def batch_alpha(self) -> float:
        """The alpha a batch decodes at: its slowest row's (the loop waits for it)."""
        if self.slowest_length is None:
            return self.alpha
        return alpha_from_acceptance_length(self.slowest_length, self.alpha_gamma)

    def choose(self, gammas: Iterable[int] | None = None) -> tuple[int, float | None]:
        """The best gamma and its predicted speedup over autoregressive decoding (None without
        T_T: T_T scales every gamma's time alike, so the choice needs none)."""
        gammas = gammas or sorted(self.t_v)
        best, speedup = choose_gamma(self.t_d, self.t_t or 1.0, self.t_v, self.batch_alpha, gammas)
        return best, None if self.t_t is None else speedup

    def token_ms(self, gamma: int) -> float:
        """Milliseconds a token at ``gamma``: (gamma T_D + T_V(gamma)) / Omega (the batch's)."""
        return relative_time(gamma, self.batch_alpha, self.t_d, 1.0, self.t_v[gamma])


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
    return _run(engine, prog, target, dw, ids, lens)[:2]


def _run(engine, prog, target, dw, ids, lens) -> tuple[float, float, float]:
    """A greedy run's ``_lengths`` and its ms a token (``_token_ms``), the prefill included."""
    out, wall, _ = base.on_device(engine.decode, prog, target.weights, dw, ids, lens, 0)
    return (*_lengths(out), _token_ms(wall, out))


def _token_ms(wall_s: float, out) -> float:
    """Milliseconds a token of a loop that took ``wall_s`` for its ``Out``'s iterations: the
    time an iteration over the slowest row's tokens an iteration (the batch waits for it).
    0 when no iteration ran (every row done at its prefill)."""
    steps = int(np.asarray(out.steps))
    if steps == 0:
        return 0.0
    return wall_s * 1e3 / steps / slowest_row_length(out.emitted, out.live_steps)


def _lengths(out) -> tuple[float, float]:
    """(mean tokens per verification, the slowest row's) of a run's ``Out`` (numpy)."""
    length = float(np.asarray(out.emitted).sum() / max(np.asarray(out.live_steps).sum(), 1))
    return length, slowest_row_length(out.emitted, out.live_steps)


def _quiet(message: str) -> None:
    pass


_SNAPSHOT = jax.jit(tree.snapshot, static_argnums=1)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``measure`` compiles and times (``plan``: this backend's).

    ``timed``: the gammas whose T_V is timed (None: every one); each other gamma's T_V is read
    off the line through its nearest timed neighbours, and ``Measurement.interpolated`` says
    which. ``t_t``: "autoregressive" times T_T as the autoregressive engine's decode step (its
    own prefill and step programs); None leaves it out: it scales every gamma's and the tree's
    time alike, so it only gives the predicted speedup over autoregressive decoding, which is
    then not reported. ``reps`` and ``steps``:
    ``units.unit_ms``'s; ``rounds``: each unit timed that many times, the units taking turns,
    and the median kept (a burst of load then slows every unit alike, not one).
    ``alpha_gamma``: the gamma of the alpha run (None: ``middle``). ``workers``: programs
    compiled at once (``programs.compile_all``). ``on_call``: the units timed on the call's own
    prefill (the alpha run's, its caches moved on towards ``prefix`` as far as they hold the
    largest verify) instead of on random prompts of ``prefix`` tokens: one prefill program
    fewer. ``t_v_from_loop``: T_V at ``alpha_gamma`` is one iteration of the alpha run's own
    streamed loop (its segment program, timed from copies of its prefill's state) less
    ``alpha_gamma`` draft steps, not a unit of its own: one program fewer (the iteration's
    acceptance and cache commit count in that T_V, a few percent of a verify).
    ``units_if_they_pay``: when the alpha run is the call's own loop, it runs first, on its
    own two programs, and T_D and T_V are compiled and timed only when the call is long
    enough for another gamma to repay the compile of its loop (``Measurement.settles``): a
    short call runs at ``alpha_gamma`` whatever they are, so timing them would only delay
    it."""

    timed: tuple[int, ...] | None = None
    t_t: str | None = "autoregressive"
    reps: int = 5
    steps: int = 8
    rounds: int = 1
    alpha_gamma: int | None = None
    workers: int = 1
    on_call: bool = False
    t_v_from_loop: bool = False
    units_if_they_pay: bool = False


def plan(gammas, backend: str | None = None) -> Plan:
    """How ``tune`` measures on ``backend`` (default: JAX's). A GPU times every term.

    A CPU, where each program costs seconds of compiling (SmolLM2-135M on 2 cores: 2.3-3.1 s
    a unit, 5-7 s the loop's segment; the whole measuring took 47-50 s), compiles fewer and
    times less; measured there at batch 1, prefix 64 (medians of 7 interleaved rounds):

    - The call's own loop (its prefill and segment, which the run needs anyway) runs its alpha
      run first, and the units are compiled and timed only when the call is long enough for
      another gamma to repay a compile (``Plan.units_if_they_pay``, ``Measurement.settles``):
      SmolLM2's tokens take about 30 ms at gamma 1 with the self-streaming draft against 6-7 s
      of compiling its loop, so calls of up to about 200 tokens time no unit. A 12-token call
      then measured for 8.4-8.7 s against 12.2-15.9 s with the units (interleaved, f687735
      against 620240e), a 128-token one for 7.8 s (benchmarks/notes/warm_start_cpu.md). A
      longer call times the units as below, after its alpha run.

    - T_V is timed at the smallest and largest gamma, the others read off their line: T_V was
      31.8, 33.5, 33.4, 34.3 ms at gamma 1-4 (the line: 32.6 and 33.5 at 2 and 3).
    - T_T is not timed (``Plan.t_t``): no choice depends on it. Its cheapest program, a
      one-token verify (24.8 ms; the autoregressive step 24.2, whose own prefill and step
      programs took 8.0 s of compiling), cost about 5 s of compile CPU; it is no point of T_V's
      line (31.0 there at gamma 0): one token runs as matrix-vector work.
    - The units run on the call's own prefill (``Plan.on_call``): one prefill program fewer.
    - T_V at the smallest gamma is one iteration of the call's own loop less a T_D
      (``Plan.t_v_from_loop``; a call that is not streamed times a unit instead): three
      programs to compile instead of four. Interleaved with the code before it (3 rounds each),
      the measuring took 15.6-18.2 s against 18.8-20.3 s, the compiling 8.4-9.2 s against
      10.2-11.8 s.
    - Each unit is timed in 2 interleaved rounds of 4 steps (the median of the two), not 5 x
      8 steps in a row: 2.3-2.7 s for the three timings where 3 rounds took 3.6-4.0 s. Their
      precision hardly matters here: ``_choice`` keeps the measuring call's gamma unless
      another repays its compile, which on a CPU it did not.
    - Alpha is measured at the smallest gamma, on the call's own program, where ``_choice``
      keeps the measuring call unless another gamma repays its compile.
    - The programs compile on every core (up to 8): five of them took 16.2 s on two threads,
      17.5 s on one (XLA's compile of one program already keeps 1.5 cores busy)."""
    if (backend or jax.default_backend()) == "gpu":
        return Plan()
    g = sorted(set(gammas))
    timed = (g[0], g[-1]) if len(g) > 2 else tuple(g)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = max(1, min(cores or 1, 8))
    return Plan(
        timed=timed, t_t=None, reps=1, steps=4, rounds=2, alpha_gamma=g[0], workers=workers,
        on_call=True, t_v_from_loop=True, units_if_they_pay=True,
    )  # fmt: skip


def interpolate(t_v: dict[int, float], gammas) -> dict[int, float]:
    """T_V at every gamma of ``gammas``: the timed ones of ``t_v`` as they are, the others on the
    line through their nearest timed neighbours (which must bracket them)."""
    timed = sorted(t_v)
    out = {}
    for g in sorted(set(gammas)):
        if g in t_v:
            out[g] = t_v[g]
            continue
        lo = max((t for t in timed if t < g), default=None)
        hi = min((t for t in timed if t > g), default=None)
        if lo is None or hi is None:
            raise ValueError(f"T_V({g}) lies outside the timed gammas {timed}")
        out[g] = t_v[lo] + (t_v[hi] - t_v[lo]) * (g - lo) / (hi - lo)
    return out


# A call of fewer new tokens than this measures alpha on a run of its own (``alpha_tokens``
# long) rather than on the call's program: its few verifications would leave the kept profile
# a guess.
ALPHA_MIN_TOKENS = 8


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
    req: base.Request | None = None,
    streamed: bool = True,
    plan: Plan | None = None,
    alpha_tokens: int = 32,
    seed: int = 0,
    progress=None,
) -> Measurement:
    """T_T, T_D and T_V(gamma) on random prompts of ``batch`` x ``prefix`` through the engines'
    units, and alpha from a short greedy chain run at ``plan.alpha_gamma`` on ``ids``/``lens``
    when given (else on the random prompts). ``draft``: what ``generate`` takes for magicdec;
    ``options``: its draft options (budget, sinks, ...); ``plan``: what is timed and how
    (default: every term); ``progress(message)`` before each part.

    The chain programs of every gamma are built with one cache capacity, so one state (after
    the prefill) serves all their units, and a verify is timed on a proposal of zeros (a greedy
    verify costs the same whatever it is shown): one compile per gamma instead of three.

    The alpha run is the call's own program when ``req`` (the call's request) is given, greedy
    and at least ``ALPHA_MIN_TOKENS`` long: its first ``alpha_tokens`` tokens, through the
    streamed loop's programs when ``streamed`` (those ``jaxspec.stream`` and the CLI run), else
    the whole loop when the call is no longer than ``alpha_tokens``. A run at the gamma the cost
    model then chooses finds its programs compiled. Every program is compiled before any timing
    (``programs.compile_all``, ``plan.workers`` at once), so no compile runs beside a timing."""
    plan = plan or Plan()
    options = options or magicdec.Options(gamma=max(gammas))
    say = progress or _quiet
    d, dw = magicdec.resolve_draft(target, draft, options, kernels)
    gammas = sorted(set(gammas))
    top = max(gammas)
    timed = gammas if plan.timed is None else sorted(set(plan.timed) & set(gammas))
    interpolate({g: 0.0 for g in timed}, gammas)  # the timed gammas bracket the others
    alpha_gamma = plan.alpha_gamma or middle(gammas)
    rand_ids, rand_lens = _random_prompts(target.config, batch, prefix, seed)
    tw, dflat = target.weights, None if dw is None else dw.flat
    if ids is None:
        ids, lens = rand_ids, rand_lens

    def chain_prog(g, r=None):
        r = r or _request(batch, prefix, 2 + top - g)  # the capacity of the largest gamma
        opts = magicdec.chain_options(options, g)
        return chain.ENGINE.program(target, None, opts, r, kernels, resolved=(d, dw))[0]

    # the alpha run: the call's own program where it can be, else a run of its own
    own = req is not None and req.sampling == GREEDY and req.max_new >= ALPHA_MIN_TOKENS
    areq = dataclasses.replace(req, sampling=GREEDY) if own else None
    whole = own and not streamed and areq.max_new <= alpha_tokens
    areq = areq or _request(ids.shape[0], ids.shape[1], alpha_tokens)
    run_prog = chain_prog(alpha_gamma, areq)
    ar = None
    if plan.t_t == "autoregressive":
        ar_req = _request(batch, prefix, 2)
        ar, _ = autoregressive.ENGINE.program(
            target, None, autoregressive.Options(), ar_req, kernels
        )
    run_init = (
        base.run_job(chain.decode, run_prog, tw, dw, ids, lens, 0, "the alpha run's loop")
        if whole
        else base.stream_init_job(chain.ENGINE, run_prog, tw, dw, ids, lens, 0)
    )
    run_state, early = None, None
    if plan.units_if_they_pay and own:  # the alpha run first, on the call's own programs
        programs.compile_all([run_init], progress=say)
        loop_s = programs.built_seconds(run_init)
        if not whole:
            run_state = run_init.compiled()[0](*run_init.args)
            seg = base.segment_job(chain.ENGINE, run_prog, tw, dw, ids, lens, 0, run_state[0])
            programs.compile_all([seg], progress=say)
            loop_s += programs.built_seconds(seg)
        say(f"measuring alpha: up to {alpha_tokens} tokens of a greedy chain run at gamma "
            f"{alpha_gamma} (the call's own program)")  # fmt: skip
        if whole:
            early = _run(chain.ENGINE, run_prog, target, dw, ids, lens)
        else:
            copy = (jax.tree.map(jnp.copy, run_state[0]), run_state[1])  # the units' state stays
            early = _first_tokens(run_prog, target, dw, ids, lens, copy, alpha_tokens)
        length, slowest, own_ms = early
        m = Measurement(
            batch, prefix, None, None, {}, alpha_from_acceptance_length(length, alpha_gamma),
            alpha_gamma, length, slowest, loop_compile_s=loop_s, own_token_ms=own_ms,
        )  # fmt: skip
        call_s = areq.max_new * own_ms / 1e3
        if m.settles(areq.max_new):
            say(f"T_D and T_V not timed: the call's {areq.max_new} tokens take about "
                f"{call_s:.1f} s at gamma {alpha_gamma}, no more than another gamma's loop "
                f"would take to compile ({loop_s:.1f} s)")  # fmt: skip
            return m
        say(f"the call's {areq.max_new} tokens take about {call_s:.1f} s at gamma "
            f"{alpha_gamma}, more than another gamma's loop takes to compile ({loop_s:.1f} s): "
            "timing T_D and T_V")  # fmt: skip
    if plan.on_call:  # the units' state: the call's prefill, its caches moved on towards prefix
        first, unit_ids, unit_lens = run_prog, ids, lens
        longest = int(np.max(lens))
        shift = max(0, min(prefix - longest, run_prog.capacity - longest - top - 1))
    else:  # random prompts of the prefix's length, in a cache that holds the largest gamma
        first, unit_ids, unit_lens, shift = chain_prog(gammas[0]), rand_ids, rand_lens, 0
    jobs = [run_init]
    if not (plan.on_call and not whole):
        jobs.append(
            units.init_job(chain.ENGINE, first, tw.flat, dflat, unit_ids, unit_lens, shift=shift)
        )
    if ar is not None:
        jobs.append(units.init_job(autoregressive.ENGINE, ar, tw.flat, None, rand_ids, rand_lens))
    programs.compile_all(jobs, workers=plan.workers, progress=say)
    if not whole and run_state is None:  # the alpha run's prefill: its segment is lowered on it
        run_state = run_init.compiled()[0](*run_init.args)
    if plan.on_call and not whole:
        state = chain.ENGINE.shifted(first, run_state[0], shift)
    else:
        state = units.initial(
            chain.ENGINE, first, tw.flat, dflat, unit_ids, unit_lens, shift=shift
        )  # fmt: skip
    context = int(np.max(unit_lens)) + shift
    ar_state = None if ar is None else units.initial(
        autoregressive.ENGINE, ar, tw.flat, None, rand_ids, rand_lens
    )  # fmt: skip

    # every unit timed, as (what, unit, program, state, aux); a verify's program is any of the
    # chain's (it verifies what it is shown), a propose's the chain's at gamma 1
    timings = {}
    if ar is not None:
        timings["T_T"] = (
            "one target decode step", autoregressive.ENGINE.units(ar)["verify"], ar, ar_state, None
        )  # fmt: skip
    one = dataclasses.replace(first, gamma=1)
    propose = chain.ENGINE.units(one)["draft"]
    timings["T_D"] = (f"one {type(d).__name__} draft step", propose, one, state, None)
    # T_V at the alpha gamma from the alpha run's own loop (Plan.t_v_from_loop)
    from_loop = plan.t_v_from_loop and not whole and alpha_gamma in timed
    for g in timed:
        if from_loop and g == alpha_gamma:
            continue
        prog = first if plan.on_call else chain_prog(g)
        verify = chain.ENGINE.units(prog)["verify"]
        what = f"one target verify of {g + 1} tokens"
        timings[f"T_V(gamma={g})"] = (what, verify, prog, state, _zeros(batch, g))
    jobs = [
        units.unit_job(u, p, tw.flat, None if p is ar else dflat, st, aux, what=name)
        for name, (_, u, p, st, aux) in timings.items()
    ]
    if not whole:
        jobs.append(base.segment_job(chain.ENGINE, run_prog, tw, dw, ids, lens, 0, run_state[0]))
    programs.compile_all(jobs, workers=plan.workers, progress=say)
    # what the loop took to build, whichever call built it: another gamma's would cost as much
    loop_s = programs.built_seconds(run_init)
    loop_s += 0.0 if whole else programs.built_seconds(jobs[-1])

    rounds = {name: [] for name in timings}
    loop_name = f"one iteration of the alpha run's loop at gamma {alpha_gamma}"
    if from_loop:
        seg = jobs[-1].compiled()[0]
        rounds["loop"] = []
    names = [*timings, *(["the alpha run's loop"] if from_loop else [])]
    if plan.rounds > 1:
        say(f"timing {', '.join(names)} in {plan.rounds} interleaved rounds (batch {batch}, "
            f"{context} cached tokens)")  # fmt: skip
    for _ in range(plan.rounds):
        for name, (what, u, p, st, aux) in timings.items():
            if plan.rounds == 1:
                say(f"timing {name}, {what} (batch {batch}, {context} cached tokens)")
            pflat = None if p is ar else dflat
            rounds[name].append(
                units.unit_ms(u, p, tw.flat, pflat, st, reps=plan.reps, steps=plan.steps, aux=aux)
            )
        if from_loop:
            if plan.rounds == 1:
                say(f"timing {loop_name} (batch {batch}, {context} cached tokens)")
            rounds["loop"].append(_iteration_ms(seg, tw.flat, dflat, run_state[0]))
    measured = {name: statistics.median(ts) for name, ts in rounds.items() if None not in ts}
    if from_loop and "loop" in measured:
        t_v_loop = max(measured.pop("loop") - alpha_gamma * measured["T_D"], 1e-3)
        measured[f"T_V(gamma={alpha_gamma})"] = t_v_loop
        say(f"T_V(gamma={alpha_gamma}) = {loop_name} less {alpha_gamma} T_D")
    elif from_loop:  # the loop ended at once (every row done): a unit of its own after all
        measured.pop("loop", None)
        prog = first if plan.on_call else chain_prog(alpha_gamma)
        verify = chain.ENGINE.units(prog)["verify"]
        measured[f"T_V(gamma={alpha_gamma})"] = statistics.median(
            units.unit_ms(verify, prog, tw.flat, dflat, state, reps=plan.reps,
                          steps=plan.steps, aux=_zeros(batch, alpha_gamma))
            for _ in range(plan.rounds)
        )  # fmt: skip
    t_v = {g: measured[f"T_V(gamma={g})"] for g in timed}
    interpolated = tuple(g for g in gammas if g not in t_v)
    if interpolated:
        say(f"T_V(gamma={', '.join(map(str, interpolated))}) read off the line through the "
            f"timed T_V(gamma={', '.join(map(str, timed))})")  # fmt: skip
    t_v = interpolate(t_v, gammas)

    if early is None:
        what = "the call's own program" if own else "a run of its own"
        say(f"measuring alpha: up to {alpha_tokens} tokens of a greedy chain run at gamma "
            f"{alpha_gamma} ({what})")  # fmt: skip
        if whole:
            early = _run(chain.ENGINE, run_prog, target, dw, ids, lens)
        else:
            early = _first_tokens(run_prog, target, dw, ids, lens, run_state, alpha_tokens)
    length, slowest, own_ms = early
    alpha = alpha_from_acceptance_length(length, alpha_gamma)
    return Measurement(
        batch, prefix, measured.get("T_T"), measured["T_D"], t_v, alpha, alpha_gamma, length,
        slowest, interpolated=interpolated, loop_compile_s=loop_s if own else None,
        own_token_ms=own_ms if own else None,
    )  # fmt: skip


def _iteration_ms(seg, tflat, dflat, state) -> float | None:
    """Milliseconds of one iteration of a streamed loop's ``seg`` program, run from fresh copies
    of ``state`` (a loop's prefill state, which stays valid) for 1 and then 3 iterations: the
    difference over the iterations run (``Out.steps``), so the call's own cost cancels. None
    when no iteration ran between them (every row done)."""

    def timed(limit: int) -> tuple[float, int]:
        st = jax.block_until_ready(jax.tree.map(jnp.copy, state))
        t0 = time.perf_counter()
        _, out = seg(tflat, dflat, st, np.int32(limit))
        steps = int(jax.device_get(out.steps))
        return time.perf_counter() - t0, steps

    (t1, s1), (t3, s3) = timed(1), timed(3)
    return None if s3 <= s1 else (t3 - t1) / (s3 - s1) * 1e3


def _zeros(batch: int, g: int):
    """A greedy verify's proposal of ``g`` tokens (a verify costs the same whatever it is shown)."""
    return np.zeros((batch, g), np.int32), None


def _first_tokens(prog, target, dw, ids, lens, first, tokens: int) -> tuple[float, float, float]:
    """``_lengths`` of a streamed run's first ``tokens`` tokens per row (or until every row is
    done), from ``first`` (its prefill's (state, out), the state donated), and its ms a token
    (``_token_ms``, the segments' launches included): its segments, compiled."""
    tw, dflat = target.weights, None if dw is None else dw.flat
    seg, _ = base.segment_job(chain.ENGINE, prog, tw, dw, ids, lens, 0, first[0]).compiled()
    s, out = first[0], jax.device_get(first[1])
    t0 = time.perf_counter()
    while True:
        live = ~np.asarray(out.done)
        if not live.any() or np.asarray(out.count)[live].min() >= tokens:
            return (*_lengths(out), _token_ms(time.perf_counter() - t0, out))
        need = tokens - int(np.asarray(out.count)[live].min())
        s, snap = seg(tw.flat, dflat, s, np.int32(-(-need // (prog.gamma + 1))))
        out = jax.device_get(snap)


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
) -> tuple[str, int | None, float | None]:
    """("chain", gamma, speedup) or ("tree", None, speedup): the shape the cost model predicts
    fastest (ties: the chain) and its predicted speedup T_AR / T_SD (None without T_T, which
    the choice does not need: both shapes' times are relative to it)."""
    gamma, speedup = chain_m.choose(gammas)
    if tree_m is not None:
        tree_ms = tree_m.relative_time(1.0)  # ms a token, as Measurement.token_ms
        if tree_ms < chain_m.token_ms(gamma):
            return "tree", None, None if chain_m.t_t is None else chain_m.t_t / tree_ms
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
    target, draft, options: magicdec.Options, ids, lens, kernels, progress=None, profile_dir=None,
    req: base.Request | None = None, streamed: bool = False,
):  # fmt: skip
    """MagicDec's open choices (``gamma="auto"``, ``shape="auto"``) by the cost model, measured
    once per (draft, batch, prefix bucket) and kept with the draft's model, and in
    ``profile_dir`` when given (``measure.profiles``: a later process on this machine reuses
    it): (options with the chosen shape and gamma, what was chosen and from what). ``req``:
    the call's request, ``streamed``: whether it is streamed (``measure``'s alpha run is then
    the call's own program)."""
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
    call_tokens = None if req is None else req.max_new
    if m is not None and not m.timed_units and (shape == "auto" or not m.settles(call_tokens)):
        m = None  # kept without T_D and T_V by a shorter call: this one may need them
    if m is None:
        how = plan(gammas)
        if shape == "auto":  # the tree is weighed against the best chain: every unit it needs
            how = dataclasses.replace(how, units_if_they_pay=False)
        if progress:
            line = "" if how.timed is None else f" (timed at {', '.join(map(str, how.timed))})"
            t_t = "T_T, " if how.t_t else ""
            units = f"{t_t}T_D, T_V for gamma {', '.join(map(str, gammas))}{line}"
            what = (
                f"alpha, then {units} if the call is long enough for another gamma to repay "
                "its compile"
                if how.units_if_they_pay
                else f"{units}, alpha"
            )
            progress(f"measuring MagicDec's cost model (batch {b}, prefix {bucket}): {what}")
        m = measure(
            target, draft, b, bucket, gammas, options=options, kernels=kernels, ids=ids,
            lens=lens, req=req, streamed=streamed, plan=how, progress=progress,
        )  # fmt: skip
        profiles.keep(owner, key, profile_dir, {**described, "kind": "magicdec-chain"}, m)
    # the measuring call compiled its loop at the alpha gamma, and the persistent compile cache
    # keeps it for a later process: every call weighs switching away against that compile
    tokens = None if req is None or m.loop_compile_s is None else req.max_new
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
    return _choice(options, m, tm, tokens)


def compiled_pays(m: Measurement, best: int, tokens: int) -> bool:
    """Whether a call of ``tokens`` new tokens at ``best`` would save more time than compiling
    ``best``'s loop costs (the seconds the loop at ``m.alpha_gamma``, already compiled by the
    measuring, took), against running at ``m.alpha_gamma``."""
    saved_s = tokens * (m.token_ms(m.alpha_gamma) - m.token_ms(best)) / 1e3
    return saved_s > m.loop_compile_s


def _choice(
    options: magicdec.Options, m: Measurement, tm: TreeMeasurement | None, tokens=None
):  # fmt: skip
    """(the options with the shape and gamma the cost model picks, the record of the choice).
    ``tokens``: the call's new tokens, when the measuring compiled the call's loop at
    ``m.alpha_gamma`` (``measure``'s alpha run; ``m.loop_compile_s``): the call runs at that
    gamma unless the cost model's best gamma saves more than its compile costs
    (``compiled_pays``), the measuring call and every later one alike, so a later process of the
    same shapes finds the measuring call's loop in the persistent compile cache. On 2 loaded
    cores the self-streaming SmolLM2 draft's gammas 1 and 4 came within timing noise of each
    other (T_V hardly grows with gamma there and alpha is 1 while the prompt fits the budget:
    1.997 and 1.994 x T_AR in one run), so the noise picked 1, 2 or 4; a run at a gamma other
    than the alpha run's compiled its loop again (8-39 s in those runs) to gain nothing
    measurable, and so did a later process that chose by the kept profile alone (27 s). A
    measurement without T_D and T_V (``Plan.units_if_they_pay``) is of a call too short for
    any other gamma to repay its compile: the chain at ``m.alpha_gamma``, no best gamma."""
    if not m.timed_units:  # the call is too short for another gamma to repay its compile
        chosen_shape, gamma, speedup = "chain", m.alpha_gamma, None
    else:
        chosen_shape, gamma, speedup = choose_shape(m, tm)
    best = gamma if m.timed_units else None
    if (
        chosen_shape == "chain" and tokens and gamma != m.alpha_gamma
        and m.alpha_gamma in m.t_v and not compiled_pays(m, gamma, tokens)
    ):  # fmt: skip
        gamma = m.alpha_gamma
        speedup = None if m.t_t is None else m.t_t / m.token_ms(gamma)
    cost = dict(
        t_t_ms=m.t_t, t_d_ms=m.t_d, t_v_ms=dict(m.t_v), alpha=m.alpha,
        alpha_slowest_row=m.batch_alpha, prefix_bucket=m.prefix,
        t_v_interpolated=list(m.interpolated), best_gamma=best,
        alpha_gamma=m.alpha_gamma, loop_compile_s=m.loop_compile_s,
        own_token_ms=m.own_token_ms, units_timed=m.timed_units,
    )  # fmt: skip
    if tm is not None:
        cost["tree"] = dict(
            t_e_ms=tm.t_e, t_v_ms=tm.t_v, acceptance_length=tm.acceptance_length,
            token_ms=tm.relative_time(1.0),
            predicted_speedup=None if m.t_t is None else 1.0 / tm.relative_time(m.t_t),
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
                lens=lens,
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
