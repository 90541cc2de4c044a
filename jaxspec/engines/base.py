"""The engine interface and what every engine shares.

An engine (``ENGINES[method]``, filled in ``jaxspec.engines``) has:

- ``Options``: a frozen dataclass of its options, parsed once from ``generate``'s keywords
  (``Options.parse``): an unknown name or a bad value is an ``OptionError`` naming the option;
- ``program(target, draft, options, request, kernels)``: the static, hashable ``Program`` a run
  compiles (models' ``Net``s, the resolved draft, shapes), and the draft's ``Weights``;
- its pure pieces over a pytree ``State``: ``init(prog, tflat, dflat, ids, lens, seed)``,
  ``step(prog, tflat, dflat, state)`` and the draft / verify / commit functions they compose;
- ``units(prog)``: the pieces a measurement times (``Unit``: "draft", "verify"), so the cost
  model, the time split and the SwiftSpec split chooser time the engines' own code;
- ``run(prog, target, draft_weights, ids, lens, seed) -> Run``: tokens, counts and ``Stats``.

Shared here: the output bookkeeping (``Out``, ``first``, ``emit``), the loop (``until_done``),
its streamed segments (``segments``) and the stats types. Programs come from the one compile
cache (``programs.compiled``), keyed by the program, the weights' layout and the argument
shapes, so a warm call costs a dict lookup and a dispatch.

long: the interface, the options' parsing, the loop and its streamed segments and the stats are
the one contract every engine and measurement shares; cut apart, each piece would import the
others (a move of the segments out of this file made a cycle through ``Engine.stream``).
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
import typing
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from jaxspec import distributed
from jaxspec.engines.programs import Job, Timer, shapes_key
from jaxspec.errors import OptionError
from jaxspec.kernels import COMMAND_BUFFER, KernelConfig
from jaxspec.model.kv_cache import init_cache
from jaxspec.model.prefill import prefill
from jaxspec.model.transformer import Model, Net, Weights
from jaxspec.pytree import pytree_dataclass
from jaxspec.spec.sampling import Sampling, sample

# ---------------------------------------------------------------- a request's static part


@dataclasses.dataclass(frozen=True)
class Request:
    """What a call fixes besides the models and options: the padded batch's shape, the token
    budget, the sampling settings and the stop tokens (all static in the compiled loop)."""

    batch: int
    width: int  # padded prompt width
    max_new: int
    sampling: Sampling
    eos: tuple[int, ...]


# ---------------------------------------------------------------- output bookkeeping


@pytree_dataclass
class Out:
    """Emitted tokens and the loop's counters, the same in every engine."""

    tokens: Int[Array, "b m"]
    count: Int[Array, " b"]  # tokens emitted per row (stops growing after EOS)
    done: Bool[Array, " b"]
    steps: Int[Array, ""]  # loop iterations after the prefill
    emitted: Int[Array, " b"]  # tokens produced per iteration, summed while the row is live
    live_steps: Int[Array, " b"]  # iterations in which the row was live


def is_eos(tok: Int[Array, "*b"], eos_ids: tuple[int, ...]) -> Bool[Array, "*b"]:
    if not eos_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.isin(tok, jnp.asarray(eos_ids, jnp.int32))


def first(tok: Int[Array, " b"], req: Request) -> Out:
    """The output after the prefill's token."""
    b = tok.shape[0]
    zero = jnp.zeros((b,), jnp.int32)
    tokens = jnp.zeros((b, req.max_new), jnp.int32).at[:, 0].set(tok)
    done = is_eos(tok, req.eos) | (req.max_new <= 1)
    return Out(tokens, zero + 1, done, jnp.zeros((), jnp.int32), zero, zero)


def emit(o: Out, new: Int[Array, "b w"], n_new: Int[Array, " b"], eos) -> Out:
    """One iteration's output: ``n_new[b]`` tokens of ``new`` appended to live rows, stopping
    after an EOS (kept) or at the output's end; the counters advanced."""
    b, width = new.shape
    m = o.tokens.shape[1]
    i = jnp.arange(width)[None, :]
    hit = is_eos(new, eos) & (i < n_new[:, None])
    first_eos = jnp.min(jnp.where(hit, i, width), axis=1)
    take = jnp.minimum(jnp.minimum(n_new, first_eos + 1), m - o.count)
    live = ~o.done
    take = jnp.where(live, take, 0)
    dst = jnp.where(i < take[:, None], o.count[:, None] + i, m)
    tokens = o.tokens.at[jnp.arange(b)[:, None], dst].set(new, mode="drop")
    count = o.count + take
    done = o.done | (first_eos < take) | (count >= m)
    emitted = o.emitted + jnp.where(live, n_new, 0)
    return Out(tokens, count, done, o.steps + 1, emitted, o.live_steps + live)


def start(net: Net, tflat, ids, lens, key, req: Request, capacity: int, features=None):
    """The shared beginning of every engine: the target's cache (``capacity`` slots), its
    prefill, the first token drawn and the output holding it. Returns (cache, token, out, key),
    and the prompt's hidden states ``features`` names (``prefill``'s) after them when given."""
    cache = init_cache(net.cfg, ids.shape[0], capacity, net.dtype)
    logits, cache, *feats = prefill(net, tflat, cache, ids, lens, features)
    key, sub = jax.random.split(key)
    tok = sample(sub, logits, req.sampling, net)
    return cache, tok, first(tok, req), key, *feats


def until_done(step, s, chunk: int, limit=None):
    """``while not all(s.out.done): s = step(s)``, checking the condition every ``chunk``
    iterations; with ``limit`` (a traced int), at most that many iterations, rounded up to whole
    chunks: one segment of a streamed loop (``segments``), which the next segment continues
    exactly where this one stopped.

    On GPU a data-dependent ``lax.while_loop`` costs a device-to-host copy and a wait per
    iteration; a chunk pays it once per ``chunk`` steps. The steps a chunk runs after every row
    is done must change nothing (the engines mask emitting and cache growth by ``done``), and are
    not counted in ``out.steps``.
    """
    if chunk == 1:
        body = step
    else:

        def one(_, s):
            active = ~jnp.all(s.out.done)
            s = step(s)
            s.out.steps = s.out.steps - 1 + active
            return s

        def body(s):
            return jax.lax.fori_loop(0, chunk, one, s)

    if limit is None:
        return jax.lax.while_loop(lambda s: ~jnp.all(s.out.done), body, s)
    s, _ = jax.lax.while_loop(
        lambda c: ~jnp.all(c[0].out.done) & (c[1] < limit),
        lambda c: (body(c[0]), c[1] + chunk),
        (s, jnp.zeros((), jnp.int32)),
    )
    return s


# Loop iterations per check of the stop condition on a GPU: decode steps for autoregressive
# decoding; verifications for speculative loops at batch <= 8, where a step is short (~1 ms) and
# the check's round trip shows (at larger batches a chunk would mostly add wasted verifications).
AR_GPU_CHUNK = 8
SPEC_GPU_CHUNK = 4


def spec_chunk(kernels: KernelConfig, batch: int) -> int:
    return kernels.loop_steps(SPEC_GPU_CHUNK if batch <= 8 else 1)


# ---------------------------------------------------------------- options


def positive_int(name: str, value, *, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"{name} must be a positive integer, got {value!r}.")
    if maximum is not None and value > maximum:
        raise OptionError(f"{name} must be at most {maximum}, got {value}.")
    return value


def count_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise OptionError(f"{name} must be an integer >= 0, got {value!r}.")
    return value


_KIND_NAMES = {int: "an integer", float: "a number", str: "a word", type(None): "None"}


def _is_a(value, kind) -> bool:
    """Whether an option value has its field's type (a bool is no integer; any number is a
    float)."""
    if kind is object:
        return True
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, kind)


@functools.cache
def _kinds(cls) -> dict[str, tuple]:
    """Each option's accepted types, once per options class (``typing.get_type_hints``
    evaluates the annotations anew at every call: 0.3 ms of a warm generate() on CPU)."""
    return {n: typing.get_args(h) or (h,) for n, h in typing.get_type_hints(cls).items()}


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Base of every engine's options: ``parse`` rejects unknown names (listing the known
    ones); each subclass checks its values in ``__post_init__``."""

    @classmethod
    def parse(cls, method: str, raw: Mapping[str, Any]):
        known = tuple(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(raw) - set(known))
        if unknown:
            allowed = ", ".join(known) if known else "none"
            raise OptionError(
                f"method={method!r} does not take option(s) {', '.join(unknown)}; it takes: "
                f"{allowed}."
            )
        hints = _kinds(cls)
        for name, value in raw.items():
            kinds = hints[name]
            if not any(_is_a(value, k) for k in kinds):
                want = " or ".join(_KIND_NAMES.get(k, getattr(k, "__name__", "")) for k in kinds)
                raise OptionError(f"{name} must be {want}, got {value!r}.")
        return cls(**raw)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclasses.dataclass(frozen=True)
class SparseOptions(EngineOptions):
    """The sparse KV budget of a self-draft or a sparse draft model (``spec.drafts.resolve``)."""

    budget: int = 256
    sinks: int = 4
    window: int | None = None
    obs: int = 16
    pool: str = "max"

    def draft_kwargs(self) -> dict:
        """The options that shape the draft, as ``spec.drafts.resolve`` takes them."""
        names = [f.name for f in dataclasses.fields(DraftOptions) if hasattr(self, f.name)]
        return {n: getattr(self, n) for n in names}


@dataclasses.dataclass(frozen=True)
class DraftOptions(SparseOptions):
    """A draft's options: the sparse budget, and prompt lookup's n-gram."""

    ngram: int = 3


# ---------------------------------------------------------------- stats


@dataclasses.dataclass
class Stats(Mapping):
    """A run's statistics, typed; also a read-only mapping (``stats["wall_s"]``) for code that
    reads it as a dict. ``wall_s`` is the engine's own time from dispatch to the result
    (compiles excluded, ``compile_s``); ``acceptance_length`` is tokens per target step of a live
    row (1 for autoregressive)."""

    method: str = ""
    wall_s: float = 0.0
    compile_s: float = 0.0
    new_tokens: int = 0
    tokens_per_s: float = 0.0
    target_steps: int = 0
    draft_steps: int = 0
    acceptance_length: float = 1.0
    tuning: dict | None = None  # what measure.tuning chose for open options, and from what

    def __getitem__(self, key: str):
        if key in self._names():
            return getattr(self, key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(k for k in self._names() if getattr(self, k) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        names = cls.__dict__.get("_NAMES")
        if names is None:
            names = tuple(f.name for f in dataclasses.fields(cls))
            cls._NAMES = names
        return names

    def to_dict(self) -> dict:
        return {k: self[k] for k in self}


@dataclasses.dataclass
class SpecStats(Stats):
    gamma: int | None = None


@dataclasses.dataclass
class TreeStats(Stats):
    depth: int = 0
    width: int = 0
    branch: int = 0
    bs: int = 0


def loop_stats(cls, out: Out, *, wall_s, compile_s, draft_per_step: int, **fields) -> Stats:
    """Stats of an on-device loop: ``out.steps`` iterations after the prefill; acceptance
    length = tokens produced per iteration of a live row."""
    steps = int(out.steps)
    emitted, live = np.asarray(out.emitted), np.asarray(out.live_steps)
    return cls(
        wall_s=wall_s,
        compile_s=compile_s,
        target_steps=steps + 1,
        draft_steps=steps * draft_per_step,
        acceptance_length=float(emitted.sum() / max(live.sum(), 1)) if draft_per_step else 1.0,
        **fields,
    )


# ---------------------------------------------------------------- the engine interface


@dataclasses.dataclass(frozen=True)
class Unit:
    """A piece a measurement times, back to back in an on-device loop: ``step(prog, tflat, dflat,
    state, aux) -> state`` keeps the state's context fixed (repeated steps cost the same) and
    keeps what it computes alive in the state; ``prepare(prog, tflat, dflat, state) -> aux``
    makes its input once, untimed (a verify's proposal). ``what`` names it for reports."""

    step: Callable
    what: str
    prepare: Callable | None = None


@dataclasses.dataclass
class Run:
    """What ``Engine.run`` returns: tokens ``[B, max_new]``, counts ``[B]`` and the stats."""

    tokens: np.ndarray
    count: np.ndarray
    stats: Stats


class Engine:
    """One decoding method (see the module docstring)."""

    name: ClassVar[str]
    Options: ClassVar[type[EngineOptions]] = EngineOptions
    needs_draft: ClassVar[bool] = True
    init: ClassVar[Callable]  # (prog, tflat, dflat, ids, lens, seed) -> State
    step: ClassVar[Callable]  # (prog, tflat, dflat, State) -> State
    decode: ClassVar[Callable]  # (prog, tflat, dflat, ids, lens, seed) -> Out: the whole loop

    def program(self, target: Model, draft, options, req: Request, kernels) -> tuple[Any, Any]:
        raise NotImplementedError

    def stats(self, prog, out: Out, wall_s: float, compile_s: float) -> Stats:
        """The typed stats of a finished on-device loop (``out`` as numpy)."""
        raise NotImplementedError

    def run(
        self, prog, target: Model, draft: Weights | None, ids, lens, seed: int, *, progress=None
    ) -> Run:
        """The whole loop (``decode``) as one program: compiled once, run, waited for.
        ``progress(message)`` hears of a compile before it starts."""
        out, wall_s, compile_s = on_device(
            self.decode, prog, target.weights, draft, ids, lens, seed,
            progress=progress, what=loop_name(self, prog),
        )  # fmt: skip
        return Run(out.tokens, out.count, self.stats(prog, out, wall_s, compile_s))

    def stream(
        self, prog, target: Model, draft, ids, lens, seed: int, *, steps: int, progress=None
    ):
        """``run``, as a generator: yields ``(tokens [B, max_new], count [B])`` (numpy) after the
        prefill and after each segment of at most ``steps`` loop iterations (``segments``), and
        returns the ``Run``. The tokens are exactly ``run``'s."""
        out, wall_s, compile_s = yield from segments(
            self, prog, target.weights, draft, ids, lens, seed, steps=steps, progress=progress
        )
        return Run(out.tokens, out.count, self.stats(prog, out, wall_s, compile_s))

    def units(self, prog) -> dict[str, Unit]:
        raise NotImplementedError

    def shifted(self, prog, state, k: int):
        """``state`` with its caches' contexts ``k`` tokens longer (a measurement times units
        at the middle of a run's context); sparse caches and prompt lookup keep theirs."""
        raise NotImplementedError

    def open_choices(self, options) -> tuple[str, ...]:
        """Options left for ``measure.tuning`` to choose by measuring (none by default)."""
        return ()


ENGINES: dict[str, Engine] = {}


def register(engine: Engine) -> Engine:
    ENGINES[engine.name] = engine
    return engine


def on_device(
    fn, prog, target: Weights, draft: Weights | None, ids, lens, seed: int, *, progress=None,
    what: str = "",
):  # fmt: skip
    """Run the on-device program ``fn(prog, tflat, dflat, ids, lens, seed)``: compiled once,
    called, waited for. Returns (outputs as numpy, wall seconds, compile seconds)."""
    seed = np.uint32(seed)
    dflat = None if draft is None else draft.flat
    exe, compile_s = run_job(fn, prog, target, draft, ids, lens, seed, what).compiled(progress)
    with Timer() as t:  # every process gets the outputs, however the weights are laid out
        out = distributed.fetch(exe(target.flat, dflat, ids, lens, seed))
    return out, t.s, compile_s


def run_job(fn, prog, target: Weights, draft: Weights | None, ids, lens, seed, what="") -> Job:
    """``on_device``'s program ``fn(prog, tflat, dflat, ids, lens, seed)`` as a ``Job``."""
    seed = np.uint32(seed)
    dflat = None if draft is None else draft.flat
    key = _run_key(target, draft, ids, lens, seed)
    return Job(fn, prog, (target.flat, dflat, ids, lens, seed), key, what=what)


def _run_key(target: Weights, draft: Weights | None, *small) -> tuple:
    return (target.layout, None if draft is None else draft.layout, shapes_key(*small))


def loop_name(engine: Engine, prog) -> str:
    """How a progress message names an engine's loop program."""
    req = getattr(prog, "req", None)
    if req is None:
        return f"the {engine.name} loop"
    return (
        f"the {engine.name} loop (batch {req.batch}, prompts padded to {req.width} tokens, "
        f"{req.max_new} new tokens)"
    )


# ---------------------------------------------------------------- streaming

# Loop iterations per streamed segment (``segments``), by backend. On an H200 (SmolLM2, 1K
# context, 128 tokens) streaming at 16 iterations cost 2.0% of autoregressive tokens/s and 0.3%
# for chain + prompt lookup with the real weights (3.0% and 3.7% at 32), and 1.8% / 3.2% with
# random weights of the same shape, the first piece after 5.5-6.7 ms (benchmarks/results/
# small_model.json, `streaming`): a piece every ~10 ms, within the 5% allowed. Before the
# segments' loops ran on the device (``STREAM_XLA_OPTIONS``) a boundary cost 1.7-2 ms and 64
# iterations were the shortest near 5%. A CPU step takes tens of milliseconds, so there every
# iteration is a segment.
STREAM_STEPS = {"gpu": 16, "cpu": 1}

# XLA options of a streamed segment's program, by backend. On a GPU XLA runs a data-dependent
# loop from the host (a copy of its condition and a wait per iteration), so a launch returned
# only when the segment's loop ended, and the next could not be queued behind it: each boundary
# left the device idle for the launch and the thread's work (on an H200, SmolLM2 shape: a launch
# on a finished state 0.96-1.4 ms, then 0.8-1.9 ms between launches). In a command buffer (a
# CUDA graph with conditional nodes) the loop runs on the device and the launch returns at once.
STREAM_XLA_OPTIONS = {"gpu": {"xla_gpu_enable_command_buffer": COMMAND_BUFFER}}


def stream_steps(steps=None) -> int:
    """Iterations per streamed segment: ``steps``, else this backend's ``STREAM_STEPS``."""
    if steps is None:
        return STREAM_STEPS["gpu" if jax.default_backend() == "gpu" else "cpu"]
    return positive_int("segment_steps", steps)


def _stream_init(static, tflat, dflat, ids, lens, seed):
    engine, prog = static
    s = engine.init(prog, tflat, dflat, ids, lens, seed)
    return s, s.out


def _stream_segment(static, tflat, dflat, s, limit):
    engine, prog = static
    s = until_done(lambda s: engine.step(prog, tflat, dflat, s), s, prog.chunk, limit)
    return s, s.out  # the output twice: the state's is donated to the next segment


def stream_init_job(engine: Engine, prog, target: Weights, draft, ids, lens, seed) -> Job:
    """The first program of a streamed loop (``segments``): ``init``, returning (state, out)."""
    seed = np.uint32(seed)
    dflat = None if draft is None else draft.flat
    return Job(
        _stream_init, (engine, prog), (target.flat, dflat, ids, lens, seed),
        _run_key(target, draft, ids, lens, seed), what=f"the prefill of {loop_name(engine, prog)}",
    )  # fmt: skip


def segment_job(engine: Engine, prog, target: Weights, draft, ids, lens, seed, state) -> Job:
    """A streamed loop's segment program (``segments``): ``(tflat, dflat, state, limit) ->
    (state, out)``, the state donated; ``state`` is what its ``stream_init_job`` returned."""
    dflat = None if draft is None else draft.flat
    return Job(
        _stream_segment, (engine, prog), (target.flat, dflat, state, np.int32(1)),
        _run_key(target, draft, ids, lens, np.uint32(seed)), donate=(2,),
        what=f"a segment of {loop_name(engine, prog)}",
        options=tuple(sorted(STREAM_XLA_OPTIONS.get(jax.default_backend(), {}).items())),
    )  # fmt: skip


def segments(
    engine: Engine, prog, target: Weights, draft: Weights | None, ids, lens, seed: int, *,
    steps: int, progress=None,
):  # fmt: skip
    """The engine's on-device loop (``init``, then ``step`` until done) in segments: a compiled
    ``segment`` program runs at most ``steps`` iterations on the state, which it donates and
    returns, and a copy of the output (``Out``, a few KB). Yields ``(tokens, count)`` (numpy)
    after the prefill and after each segment; returns (the final ``Out`` as numpy, wall seconds,
    compile seconds). The iterations are the whole loop's, split at segment boundaries, so the
    tokens are exactly ``decode``'s.

    The segments run back to back on a worker thread (``_dispatch``) while this generator hands
    out the finished ones: on a GPU the call that launches a program holds its thread until the
    program's ``while`` loop ends (XLA reads each loop condition on the host), so launching the
    next segment from the consumer's thread before reading the last held every piece back by a
    segment and left the device idle while the consumer worked (33% of autoregressive tokens/s
    on an H200, benchmarks/results/small_model.json)."""
    seed = np.uint32(seed)
    dflat = None if draft is None else draft.flat
    first, compile_s = stream_init_job(engine, prog, target, draft, ids, lens, seed).compiled(
        progress
    )
    t0 = time.perf_counter()
    s, snap = first(target.flat, dflat, ids, lens, seed)
    snap = _fetching(snap)
    limit = np.int32(steps)
    # compiled while the prefill runs; its seconds are taken out of the wall below
    job = segment_job(engine, prog, target, draft, ids, lens, seed, s)
    seg, seg_compile_s = job.compiled(progress)
    done, stop = queue.SimpleQueue(), threading.Event()
    worker = threading.Thread(
        target=_dispatch, args=(lambda s: seg(target.flat, dflat, s, limit), s, done, stop),
        name="jaxspec-stream",
    )  # fmt: skip
    del s  # the worker's now (the segments donate it)
    _STREAM_STOPS.add(stop)
    worker.start()
    try:
        out = jax.device_get(snap)
        while not bool(out.done.all()):
            yield out.tokens, out.count
            out = done.get()
            if isinstance(out, BaseException):
                raise out
            out = jax.device_get(out)
        wall_s = time.perf_counter() - t0 - seg_compile_s
        yield out.tokens, out.count
        return out, wall_s, compile_s + seg_compile_s
    finally:  # a consumer that stops early stops the worker after its segment
        stop.set()
        worker.join()
        _STREAM_STOPS.discard(stop)


# the stop events of the running streams' workers: set at interpreter exit, before Python joins
# its threads, so a stream left unfinished ends after its current segment (a daemon thread
# killed inside a launch aborts the process)
_STREAM_STOPS: weakref.WeakSet = weakref.WeakSet()
if hasattr(threading, "_register_atexit"):  # as concurrent.futures stops its workers
    threading._register_atexit(lambda: [e.set() for e in list(_STREAM_STOPS)])


def _dispatch(segment, s, done: queue.SimpleQueue, stop: threading.Event) -> None:
    """``segments``' worker: run ``segment`` on the state until every row is done (or ``stop``),
    putting each segment's output on ``done`` with its copy to the host started (an exception
    instead, if one is raised); the consumer waits for the copy.

    A segment is handed out before the next is launched (a launch that holds its thread until
    its loop ends must not hold the piece back), and the next is launched before the last one's
    ``done`` flags are read: where launches return at once (loops on the device: a CPU, or a
    GPU with ``STREAM_XLA_OPTIONS``) it queues behind the running segment, so the device never
    waits for this thread. A segment launched after the last one exits at its first check."""
    try:
        s, snap = segment(s)
        while True:
            done.put(_fetching(snap))
            if stop.is_set() or (snap.done.is_ready() and bool(np.asarray(snap.done).all())):
                return
            s, following = segment(s)
            if bool(np.asarray(snap.done).all()):
                return
            snap = following
    except BaseException as e:  # the consumer re-raises it
        done.put(e)


def _fetching(out: Out) -> Out:
    """``out`` with its copy to the host started as soon as the device has it."""
    for x in jax.tree.leaves(out):
        x.copy_to_host_async()
    return out
