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
