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
