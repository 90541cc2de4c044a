"""Timing device work from the host: the median over repetitions, each waited for."""

from __future__ import annotations

import statistics
import time

import jax


def median_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn()`` (device work waited for), after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def chained_ms(fn, state, reps: int) -> float:
    """Median milliseconds of ``state = fn(state)`` after one warm-up call, starting from a copy
    of ``state`` (which stays valid). ``fn`` should donate its state: a step that writes a KV
    cache in place then costs what it costs inside the engines' loops; without donation every
    call would also copy the whole cache."""
    import jax.numpy as jnp

    state = jax.block_until_ready(fn(jax.tree.map(jnp.copy, state)))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        state = jax.block_until_ready(fn(state))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def repeat(step):
    """``run(state, k, *args)``: ``state = step(state, *args)`` k times in one on-device loop, k
    traced (one compile serves every count). Jit it with the state donated; ``loop_ms`` times it.
    ``step`` must keep what it computes alive in ``state`` (a token, a count), or the compiler
    drops it."""

    def run(state, k, *args):
        return jax.lax.fori_loop(0, k, lambda _, s: step(s, *args), state)

    return run


def loop_ms(run, state, *args, n: int = 8, reps: int = 3) -> float:
    """Milliseconds per step when steps run back to back on the device, as in the engines'
    loops: ``run`` (a jitted or compiled ``repeat(step)``, state donated) is called ``reps``
    times for 1 step and for ``n + 1`` steps, after a warm-up call; the difference of the
    fastest of each over n cancels what one call costs besides the device work (dispatching
    hundreds of arguments, the wait), which a single timed call would count: on an H200 about
    1 ms per call for SmolLM2-135M, as much as its whole forward. Starts from a copy of
    ``state`` (which stays valid); ``loop_ms_consuming`` does without the copy."""
    import jax.numpy as jnp

    return loop_ms_consuming(run, jax.tree.map(jnp.copy, state), *args, n=n, reps=reps)[0]


def loop_ms_consuming(run, state, *args, n: int = 8, reps: int = 3):
    """``loop_ms`` on ``state`` itself (donated: for a cache that fits only once): (ms, the
    state after the last step)."""
    import jax.numpy as jnp

    def call(k):
        nonlocal state
        t = time.perf_counter()
        state = jax.block_until_ready(run(state, k, *args))
        return time.perf_counter() - t

    one, more = jnp.int32(1), jnp.int32(n + 1)
    call(one)
    ones, mores = zip(*((call(one), call(more)) for _ in range(reps)), strict=True)
    return max((min(mores) - min(ones)) / n * 1e3, 1e-6), state
