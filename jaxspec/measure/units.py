"""Timing an engine's own pieces (``Engine.units``) as its loop runs them.

Every measurement of the library goes through here: MagicDec's cost model, the time split of a
benchmark, SwiftSpec's profile. A unit's steps run back to back in one on-device loop with the
state donated (``timing.repeat``, ``timing.loop_ms``: 1 and n + 1 steps, the difference over n,
so what one host call costs besides the device work cancels out, and the compile happens in the
untimed warm-up). Programs are compiled through the engines' one cache (``programs.compiled``).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxspec.engines import base, programs
from jaxspec.timing import loop_ms, median_ms


def _init(static, tflat, dflat, ids, lens, seed):
    engine, prog, shift = static
    s = engine.init(prog, tflat, dflat, ids, lens, seed)
    return engine.shifted(prog, s, shift) if shift else s


def _prepare(static, tflat, dflat, s):
    unit, prog = static
    return unit.prepare(prog, tflat, dflat, s)


def _looped(static, s, k, tflat, dflat, aux):
    unit, prog = static
    return jax.lax.fori_loop(0, k, lambda _, st: unit.step(prog, tflat, dflat, st, aux), s)


def _key(*trees) -> tuple:
    leaves, treedef = jax.tree.flatten(trees)
    return treedef, tuple(
        (np.shape(x), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None))
        for x in leaves
    )


def init_job(
    engine: base.Engine, prog, tflat, dflat, ids, lens, *, shift: int = 0, seed: int = 0
) -> programs.Job:
    """``initial``'s program, as ``programs.compile_all`` takes it."""
    args = (tflat, dflat, ids, lens, np.uint32(seed))
    what = f"the {engine.name} prefill"
    return programs.Job(_init, (engine, prog, shift), args, _key(*args), what=what)


def initial(engine: base.Engine, prog, tflat, dflat, ids, lens, *, shift: int = 0, seed: int = 0):
    """The engine's state after its ``init`` (the prefill), its caches ``shift`` tokens further
    on (``Engine.shifted``)."""
    job = init_job(engine, prog, tflat, dflat, ids, lens, shift=shift, seed=seed)
    exe, _ = job.compiled()
    return exe(*job.args)


def init_ms(engine: base.Engine, prog, tflat, dflat, ids, lens, *, reps: int = 3) -> float:
    """Milliseconds of the engine's ``init``: cache allocation, the prefill, the draft's init."""
    args = (tflat, dflat, ids, lens, np.uint32(0))
    exe, _ = programs.compiled(_init, (engine, prog, 0), args, _key(*args))
    return median_ms(lambda: exe(*args), reps)


def unit_job(unit: base.Unit, prog, tflat, dflat, state, aux=None, what: str = "") -> programs.Job:
    """``unit_ms``'s program (the unit's steps in a loop), as ``programs.compile_all`` takes it;
    ``aux`` as ``unit_ms`` is given it (a unit with a ``prepare`` needs it here)."""
    if aux is None and unit.prepare is not None:
        raise ValueError(f"{unit.what}: give the aux its prepare makes, to compile it ahead")
    args = (state, np.int32(1), tflat, dflat, aux)
    return programs.Job(
        _looped, (unit, prog), args, _key(*args), donate=(0,), what=what or unit.what
    )


def unit_ms(
    unit: base.Unit, prog, tflat, dflat, state, *, reps: int = 3, steps: int = 8, floor_ms=50.0,
    aux=None,
) -> float:  # fmt: skip
    """Milliseconds of one ``unit`` step at ``state``'s context: ``steps`` steps (``loop_ms``'s
    n), then as many as ~``floor_ms`` of them take when those were quicker (a prompt lookup costs
    microseconds), so the timed difference stands above the timer's noise. ``aux``: the unit's
    input when the caller makes it (a proposal of the right shape), else its ``prepare`` makes
    it."""
    if aux is None and unit.prepare is not None:
        args = (tflat, dflat, state)
        exe, _ = programs.compiled(_prepare, (unit, prog), args, _key(*args))
        aux = exe(*args)
    run, _ = unit_job(unit, prog, tflat, dflat, state, aux).compiled()
    t = loop_ms(run, state, tflat, dflat, aux, n=steps, reps=reps)
    if t * steps < floor_ms:
        n = min(4096, max(steps, int(floor_ms / max(t, 0.01))))
        t = loop_ms(run, state, tflat, dflat, aux, n=n, reps=reps)
    return t


def units_ms(engine: base.Engine, prog, tflat, dflat, state, *, reps: int = 3) -> dict:
    """Every unit of the engine's program, timed at ``state``: {name: ms}."""
    return {
        name: unit_ms(u, prog, tflat, dflat, state, reps=reps)
        for name, u in engine.units(prog).items()
    }
