"""The streamed loop: an engine's on-device loop in segments, run back to back by a worker
thread while the consumer reads the finished ones (``Engine.stream``, ``jaxspec.stream``)."""

from __future__ import annotations

import queue
import threading
import time
import weakref

import jax
import numpy as np

from jaxspec.engines.base import (
    Engine,
    Out,
    Weights,
    _run_key,
    compiled,
    loop_name,
    positive_int,
    until_done,
)  # fmt: skip

# Loop iterations per streamed segment (``segments``), by backend. A segment boundary costs the
# device one loop exit, one more program launch and a copy of the small output; a GPU decode
# step of the SmolLM2 shape takes ~0.7 ms (small_model.json), so 32 iterations (~22 ms, ~45
# updates a second) keep that far below the 5% allowed. A CPU step takes tens of milliseconds,
# so there every iteration is a segment.
STREAM_STEPS = {"gpu": 32, "cpu": 1}


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
    static, key = (engine, prog), _run_key(target, draft, ids, lens, seed)
    what = loop_name(engine, prog)
    first, compile_s = compiled(
        _stream_init, static, (target.flat, dflat, ids, lens, seed), key, progress=progress,
        what=f"the prefill of {what}",
    )  # fmt: skip
    t0 = time.perf_counter()
    s, snap = first(target.flat, dflat, ids, lens, seed)
    snap = _fetching(snap)
    limit = np.int32(steps)
    # compiled while the prefill runs; its seconds are taken out of the wall below
    seg, seg_compile_s = compiled(
        _stream_segment, static, (target.flat, dflat, s, limit), key, donate=(2,),
        progress=progress, what=f"a segment of {what}",
    )  # fmt: skip
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
    putting each segment's output, fetched, on ``done`` (an exception instead, if one is
    raised)."""
    try:
        while not stop.is_set():
            s, snap = segment(s)
            out = jax.device_get(_fetching(snap))
            done.put(out)
            if bool(out.done.all()):
                return
    except BaseException as e:  # the consumer re-raises it
        done.put(e)


def _fetching(out: Out) -> Out:
    """``out`` with its copy to the host started as soon as the device has it."""
    for x in jax.tree.leaves(out):
        x.copy_to_host_async()
    return out
