"""SwiftSpec's iteration as one XLA program over both devices (``loop="device"``, 1 + 1 layouts).

The threaded loop (``swiftspec_threads.ThreadLoop``) hands every verdict and snapshot through
the host: on two H200s about 3 ms of an 8.6 ms iteration passed with the target's GPU idle, in
thread wake-ups, dispatches that wait on cross-device copies, and the draft's host sync
(benchmarks/notes/swiftspec_2gpu.md). Here the same pieces run in one ``shard_map`` over a mesh of
the target's device and the draft's, inside one ``lax.while_loop``, and the handoffs are
``ppermute``s (device to device, no host):

    phase 1   device 0: verify snapshot n               device 1: grow the tree d times
    handoff   verdict n: device 0 -> device 1
    phase 2   device 0: (waits)                         device 1: re-root on verdict n,
                                                                  take snapshot n + 1
    handoff   snapshot n + 1: device 1 -> device 0

Each device runs its own branch of a ``lax.cond`` on its mesh index, so the verify and the d
expansions of phase 1 run at the same time on different devices, as in the threaded loop; only
the re-root and snapshot (short) and the two copies sit between verifications. The functions are
the threaded loop's own (``target_verify``, ``draft_grow``, ``draft_next``), so the tokens are
the same; both devices hold both states (each updates only its own; the other's is zeros), and
the loop ends on the verdict's ``done``, which both devices see.

A single-exchange variant (c4824b0: the verdict one way and the grown tree the other in one
``ppermute``, the next snapshot computed on both devices) was measured slower on two H200s:
6.52 ms an iteration against 7.83 serial (0.83x), where this loop made 6.22 against 8.27
(0.75x); it was reverted (benchmarks/notes/swiftspec_2gpu_loops.md).

The program also makes the states (the target's prefill on its device, the draft's first tree
and snapshot on its own) and returns only the tokens and counters: on two H200s (422a005) the
first version, which copied the prefilled states onto both devices and returned both whole,
spent ~170 ms a call in those copies and per-leaf slicing (9.6 ms an iteration over 47, against
a steady 6.07 in its trace; benchmarks/notes/swiftspec_2gpu.md).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.engines.base import compiled
from jaxspec.engines.swiftspec import engine as S

AXIS = "w"


def _raw(fn):
    """The Python function under a ``jax.jit`` (traced inline in the loop's program)."""
    return getattr(fn, "__wrapped__", fn)


def _zeros(shapes):
    """Zeros shaped like ``shapes`` (``jax.eval_shape`` output; PRNG keys included): the state
    a device carries for the other worker, never read."""

    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jax.random.key_data(jax.random.key(0))
            return jax.random.wrap_key_data(jnp.zeros(x.shape + data.shape, data.dtype))
        return jnp.zeros(x.shape, x.dtype)

    return jax.tree.map(one, shapes)


def _branch(me, who: int, fn, *args):
    """``fn(*args)`` on device ``who`` of the mesh; zeros of its shape on the other."""
    shapes = jax.eval_shape(fn, *args)
    return jax.lax.cond(me == who, lambda a: fn(*a), lambda a: _zeros(shapes), args)


STATIC = ("mesh", "prefill_kw", "init_kw", "grow_kw", "next_kw", "verify_kw", "bs", "d", "vlayout")


@functools.partial(jax.jit, static_argnames=STATIC)
def device_loop(
    tflat, dflat, ids, lens, key, *, mesh, prefill_kw, init_kw, grow_kw, next_kw, verify_kw, bs,
    d, vlayout,
):  # fmt: skip
    """The whole generation: ``(tflat, dflat, ids, lens, key) -> results``, every argument
    replicated on ``mesh`` (target device first, draft device second); the ``*_kw`` are the
    workers' static keywords as sorted item tuples. The states are made in the program (the
    target's prefill, the draft's first tree and snapshot), so no state crosses between the
    host and the mesh; the results are the target's tokens and the counters the engine reports,
    each stacked over the two devices."""
    prefill_kw, init_kw, grow_kw = dict(prefill_kw), dict(init_kw), dict(grow_kw)
    next_kw, verify_kw = dict(next_kw), dict(verify_kw)
    prefill, init, snapshot = _raw(S.target_prefill), _raw(S.draft_init), _raw(S.draft_snapshot)
    verify, grow, after = _raw(S.target_verify), _raw(S.draft_grow), _raw(S.draft_next)

    def per_device(tflat, dflat, ids, lens, key):
        me = jax.lax.axis_index(AXIS)
        ts, first = _branch(me, 0, functools.partial(prefill, **prefill_kw), tflat, ids, lens, key)
        first = jnp.where(me == 0, first, jax.lax.ppermute(first, AXIS, [(0, 1)]))

        def start(dflat, ids, lens, first):
            ds = init(dflat, ids, lens, first, **init_kw)
            ds = grow(dflat, ds, n=d, **grow_kw)
            return (ds, *snapshot(ds, bs=bs))

        ds, snap, flat = _branch(me, 1, start, dflat, ids, lens, first)
        flat = jnp.where(me == 0, jax.lax.ppermute(flat, AXIS, [(1, 0)]), flat)
        vshapes = jax.eval_shape(functools.partial(verify, **verify_kw), tflat, ts, flat)[2]

        def body(c):
            ts, ds, snap, flat, _, it = c

            def target_phase(args):
                ts, ds = args
                ts, _, vflat = verify(tflat, ts, flat, **verify_kw)
                return ts, ds, vflat

            def draft_phase(args):
                ts, ds = args
                return ts, grow(dflat, ds, n=d, **grow_kw), _zeros(vshapes)

            ts, ds, vflat = jax.lax.cond(me == 0, target_phase, draft_phase, (ts, ds))
            vflat = jnp.where(me == 0, vflat, jax.lax.ppermute(vflat, AXIS, [(0, 1)]))

            def reroot(args):
                ds, snap = args
                ds, snap, new, _ = after(dflat, ds, snap, vflat, **next_kw)
                return ds, snap, new

            def wait(args):
                ds, snap = args
                return ds, snap, jnp.zeros_like(flat)

            ds, snap, new = jax.lax.cond(me == 1, reroot, wait, (ds, snap))
            flat = jnp.where(me == 0, jax.lax.ppermute(new, AXIS, [(1, 0)]), new)
            done = S.unpack(vflat, vlayout).done
            return ts, ds, snap, flat, done, it + 1

        # every verification emits a token per live row, so max_new of them finish any run: the
        # bound only keeps a wrong verdict from spinning forever (nothing hangs)
        limit = ts.out.shape[1]
        init_c = (ts, ds, snap, flat, jnp.zeros((), bool), jnp.zeros((), jnp.int32))
        ts, ds, _, _, _, it = jax.lax.while_loop(lambda c: ~c[4] & (c[5] < limit), body, init_c)
        results = dict(
            out=ts.out, count=ts.count, done=ts.done, emitted=ts.emitted,
            live_steps=ts.live_steps, carried=ds.carried, recomputed=ds.recomputed, it=it,
        )  # fmt: skip
        return jax.tree.map(lambda x: x[None], results)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=PartitionSpec(),
        out_specs=PartitionSpec(AXIS),
        check_vma=False,
    )(tflat, dflat, ids, lens, key)


# The weights replicated on the two-device mesh, for the next call with the same weights:
# {key: (the caller's weight arrays, kept so that their ids stay theirs; the replicated ones)}.
_WEIGHTS: dict = {}


def replicate_weights(mesh: Mesh, tflat: list, dflat: list, sources) -> tuple[list, list]:
    """Both workers' weights on both devices (one program runs on both; each touches only its
    own): for Llama-3-8B and 3.2-1B, 16 GB more on the draft's device. The copy is kept for the
    next call whose ``sources`` (the weight arrays the caller holds, of which ``tflat`` and
    ``dflat`` are the placed forms) are the same arrays: one entry; ``clear()`` frees it."""
    key = (mesh, tuple(tuple(map(id, leaves)) for leaves in sources))
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        rep = jax.device_put((tflat, dflat), NamedSharding(mesh, PartitionSpec()))
        _WEIGHTS[key] = (sources, jax.block_until_ready(rep))
    return _WEIGHTS[key][1]


def clear() -> None:
    """Free the kept copy of the weights (``replicate_weights``)."""
    _WEIGHTS.clear()


def run(tdev, ddev, tflat, dflat, ids, lens, key, *, sources, **static) -> tuple[dict, float]:
    """Run the whole generation on the two devices: (results as numpy arrays, each the target's
    or the draft's as fits; seconds of setup: the weights' copy on a first call and the compile,
    once per shape). ``static``: ``device_loop``'s keywords as dicts (``mesh`` aside)."""
    mesh = Mesh([tdev, ddev], (AXIS,))
    t0 = time.perf_counter()
    tflat, dflat = replicate_weights(mesh, tflat, dflat, sources)
    setup_s = time.perf_counter() - t0
    # a few token ids and a key: the only inputs that are this call's own
    args = jax.device_put((ids, lens, key), NamedSharding(mesh, PartitionSpec()))
    t0 = time.perf_counter()
    static = {k: tuple(sorted(v.items())) if isinstance(v, dict) else v for k, v in static.items()}
    exe, _ = compiled(device_loop, tflat, dflat, *args, mesh=mesh, **static)
    setup_s += time.perf_counter() - t0
    res = jax.device_get(exe(tflat, dflat, *args))
    target_side = ("out", "count", "done", "emitted", "live_steps", "it")
    return {k: v[0] if k in target_side else v[1] for k, v in res.items()}, setup_s
