"""The one compile cache: a program compiled ahead of time once per (function, static program,
argument layout, donation, XLA options), kept in memory (least recently used beyond
``MAX_PROGRAMS`` dropped) and, when JAX's persistent cache is on, in the on-disk store of whole
programs (``executables``), so a warm process loads it without tracing. ``compile_all`` compiles
several programs at once. The engines (``base``), the measurements and SwiftSpec's workers look
their programs up here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxspec.engines import executables
from jaxspec.model.transformer import Net


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0


_COMPILED: collections.OrderedDict = collections.OrderedDict()
_BUILT_S: dict = {}  # the seconds each kept program took to build (``built_seconds``)
_COMPILE_LOCK = threading.Lock()
MAX_PROGRAMS = 64


def compiled(
    fn, static, args, key, *, donate: tuple[int, ...] = (), progress=None, what: str = "",
    options: Mapping[str, Any] | None = None,
) -> tuple[Any, float]:  # fmt: skip
    """``fn(static, *args)`` compiled ahead of time, once per ``(fn, static, key)``, where
    ``key`` stands for the arguments' shapes, dtypes and layouts (the weights' part precomputed:
    ``Model.layout``); returns (executable, compile seconds: 0 when found). ``static`` is the
    hashable program (a jit static argument). Least recently used programs beyond
    ``MAX_PROGRAMS`` are dropped. ``donate``: positions in ``args`` whose buffers the program
    may reuse (a state handed on). ``progress(message)``, when given, hears "compiling
    ``what``" before a compile starts (seconds on a CPU; found programs say nothing).
    ``options``: XLA options of this program besides its kernels' (``compiler_options``)."""
    extra = tuple(sorted((options or {}).items()))
    full = (fn, static, key, donate, extra)
    # one compile at a time: SwiftSpec's two worker threads compile concurrently otherwise, and
    # the engines subtract the summed compile seconds from their wall time
    with _COMPILE_LOCK:
        exe = _COMPILED.get(full)
        if exe is not None:
            _COMPILED.move_to_end(full)
            return exe, 0.0
        with Timer() as t:
            options = _options(static, extra)
            where, name, exe = _stored(full, options)
            if exe is None:
                if progress is not None:
                    progress(f"compiling {what or getattr(fn, '__name__', 'a program')}")
                exe = _finish(_lower(full, args), options, where, name)
        _keep(full, exe, t.s)
    return exe, t.s


def _keep(full, exe, seconds: float) -> None:
    """Put a program that took ``seconds`` to build in the cache (the lock held), dropping the
    least recently used."""
    _COMPILED[full] = exe
    _BUILT_S[full] = seconds
    while len(_COMPILED) > MAX_PROGRAMS:
        _BUILT_S.pop(_COMPILED.popitem(last=False)[0], None)


def built_seconds(job: Job) -> float:
    """The seconds ``job``'s program took to build in this process (loading it from the disk
    store, or lowering and compiling it), however often it was found since; 0 when it is not
    kept. What a program of its kind costs to build, where ``compile_all``'s seconds say what
    one call spent (0 for a program found)."""
    return _BUILT_S.get(job.full, 0.0) if job.full in _COMPILED else 0.0


def _options(static, extra: tuple) -> dict:
    """A program's XLA options: its kernels' (``compiler_options``), then its own."""
    return {**compiler_options(static), **dict(extra)}


def _stored(full: tuple, options: dict):
    """(folder, name, program) of ``full`` in the disk store (``executables``, when JAX's
    persistent cache is on): the program is None when not kept, the name too when the store is
    off or the program cannot be kept."""
    fn, static, key, donate, _ = full
    where = executables.folder()
    if where is None:
        return None, None, None
    name = executables.digest(fn, static, key, donate, options)
    return where, name, None if name is None else executables.load(where, name)


def _lower(full: tuple, args):
    fn, static, _, donate, _ = full
    donated = tuple(i + 1 for i in donate)
    return jax.jit(fn, static_argnums=0, donate_argnums=donated).lower(static, *args)


def _finish(lowered, options: dict, where, name):
    """Compile a lowered program, keeping it in the disk store when it has a ``name`` there."""
    if name is None:
        return lowered.compile(compiler_options=options)
    with executables.fresh():
        exe = lowered.compile(compiler_options=options)
    executables.keep(where, name, exe)
    return exe


@dataclasses.dataclass(frozen=True)
class Job:
    """One program as ``compiled`` takes it, for compiling several at once (``compile_all``);
    ``what`` names it in progress messages, ``options`` are ``compiled``'s as sorted items."""

    fn: Callable
    static: Any
    args: tuple
    key: Any
    donate: tuple[int, ...] = ()
    what: str = ""
    options: tuple = ()

    @property
    def full(self) -> tuple:
        """Its key in the compile cache."""
        return (self.fn, self.static, self.key, self.donate, self.options)

    def compiled(self, progress=None) -> tuple[Any, float]:
        """``compiled(...)`` of this job: (executable, compile seconds)."""
        return compiled(
            self.fn, self.static, self.args, self.key, donate=self.donate, progress=progress,
            what=self.what, options=dict(self.options),
        )  # fmt: skip


def compile_all(jobs, *, workers: int = 1, progress=None) -> list[float]:
    """Compile the ``jobs`` not yet in the cache, ``workers`` at once: each is read from the disk
    store or lowered here, one after another (tracing holds Python's lock), and compiled on a
    pool of ``workers`` threads (XLA releases the lock while it compiles, so the next one traces
    meanwhile, even with one worker). ``progress(message)`` hears of them first. Returns each
    job's seconds (loading, or lowering and compiling; 0 for one found in memory).

    On a CPU XLA compiles one program on one core: two SmolLM2 verify programs took 9.8 s one
    after the other and 5.9 s on two threads of two cores (``measure.cost_model.plan``)."""
    jobs = list(jobs)
    seconds = [0.0] * len(jobs)
    todo, seen = [], set()
    for i, j in enumerate(jobs):
        if j.full in seen or j.full in _COMPILED:
            continue
        seen.add(j.full)
        todo.append((i, j))
    # first every program kept on disk, one after another and before any compile starts: on a
    # CPU, two programs deserialized at once on two threads failed to run ("Function ... not
    # found"), and a compile beside a deserialization is not known to be safe either
    rest = []
    for i, j in todo:
        with Timer() as t:
            options = _options(j.static, j.options)
            where, name, exe = _stored(j.full, options)
        seconds[i] = t.s
        if exe is None:
            rest.append((i, j, options, where, name))
            continue
        with _COMPILE_LOCK:
            _keep(j.full, exe, t.s)
    if not rest:
        return seconds
    if progress is not None:
        names = [j.what or getattr(j.fn, "__name__", "a program") for _, j, *_ in rest]
        on = f" on {workers} threads" if workers > 1 else ""
        many = f"{len(rest)} programs{on}: " if len(rest) > 1 else ""
        progress(f"compiling {many}{'; '.join(names)}")

    def timed(lowered, options, where, name):
        with Timer() as t:
            exe = _finish(lowered, options, where, name)
        return exe, t.s

    pool = concurrent.futures.ThreadPoolExecutor(max(1, workers), "jaxspec-compile")
    try:
        pending = []
        for i, j, options, where, name in rest:
            with Timer() as t:
                lowered = _lower(j.full, j.args)
            seconds[i] += t.s
            pending.append((i, j.full, pool.submit(timed, lowered, options, where, name)))
        for i, full, future in pending:
            exe, s = future.result()
            seconds[i] += s
            with _COMPILE_LOCK:
                _keep(full, exe, seconds[i])
    except BaseException:  # a Ctrl-C waits for the compiles under way only, not the queued
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return seconds


def compiler_options(static) -> dict:
    """The XLA options of a program: those of the kernels of every model it runs (``Net``s found
    in the static program, its draft's included); a program with invariant numerics for any."""
    out: dict = {}
    seen = set()

    def walk(x):
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, Net):
            out.update(x.kernels.compiler_options())
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, tuple | list):
            for y in x:
                walk(y)

    walk(static)
    return out


def shapes_key(*arrays) -> tuple:
    """The (shape, dtype) of small per-call arguments, for ``compiled``'s key (an array's own
    dtype name read directly: ``np.result_type(a).name`` cost 0.03 ms a call)."""
    return tuple((np.shape(a), _dtype_name(a)) for a in arrays)


def _dtype_name(a) -> str:
    dtype = getattr(a, "dtype", None)
    return _name(dtype if isinstance(dtype, np.dtype) else np.result_type(a))


@functools.cache
def _name(dtype: np.dtype) -> str:
    return dtype.name
