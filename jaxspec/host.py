"""Process settings a warm call's host time depends on, applied only when asked for: ``jaxspec
bench`` applies them once its model is loaded; a Python program that makes many calls calls
``tune_host()`` once, after loading.

``tune_host()`` turns off glibc's fastbins (``mallopt(M_MXFAST, 0)``). XLA's CPU runtime frees
many small blocks during a program; with fastbins on, the first larger allocation afterwards
on the calling thread (a token list of 128 ints) merges them all (``malloc_consolidate``) and
stalls for 0.2-0.5 ms. Measured on the 2-core CPU (``benchmarks/bench_host_overhead.py``,
``benchmarks/notes/host_overhead.md``): the token lists' trim after a 128-token call went from
0.33 / 0.58 / 0.91 ms (autoregressive / chain / tree) to 0.19 / 0.20 / 0.41 ms, with no change
in the engines' own time. Small blocks still come from glibc's per-thread cache (tcache).

It is not free before the work starts: applied at the start of a warm one-shot ``jaxspec
generate`` (loading, reading two kept programs, 12 tokens) it made the process 0.5 s slower
(5.5-5.7 s against 5.0-5.1 s, three runs each, alternating), so ``generate`` leaves it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_MXFAST = 1  # mallopt's parameter number for the fastbin size limit (glibc malloc.h)


@functools.cache
def tune_host() -> bool:
    """Apply the settings above to this process, once. Returns whether glibc's allocator was
    tuned (False where the C library is not glibc, e.g. macOS or musl: nothing is changed)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
        return bool(libc.mallopt(M_MXFAST, 0))
    except OSError:
        return False


__all__ = ["tune_host"]
