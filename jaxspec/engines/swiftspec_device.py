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
the same; both devices hold both states (each updates only its own), and the loop ends on the
verdict's ``done``, which both devices see.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.engines import swiftspec as S
from jaxspec.engines.common import compiled

AXIS = "w"


def _raw(fn):
    """The Python function under a ``jax.jit`` (traced inline in the loop's program)."""
    return getattr(fn, "__wrapped__", fn)


@functools.partial(
    jax.jit, static_argnames=("mesh", "verify_kw", "grow_kw", "next_kw", "d", "vlayout")
)
def device_loop(tflat, dflat, ts, ds, snap, flat, *, mesh, verify_kw, grow_kw, next_kw, d, vlayout):
    """The loop: ``(tflat, dflat, ts, ds, snap, flat) -> (ts, ds, iterations)``, each stacked
    over the two devices; every argument replicated on ``mesh`` (target device first, draft
    device second). The ``*_kw`` are the workers' static keywords as sorted item tuples."""
    verify_kw, grow_kw, next_kw = dict(verify_kw), dict(grow_kw), dict(next_kw)
    verify, grow, after = _raw(S.target_verify), _raw(S.draft_grow), _raw(S.draft_next)
    vsize = sum(math.prod(shape) for shape, _ in vlayout[1])

    def per_device(tflat, dflat, ts, ds, snap, flat):
        me = jax.lax.axis_index(AXIS)

        def body(c):
            ts, ds, snap, flat, _, it = c

            def target_phase(args):
                ts, ds = args
                ts, _, vflat = verify(tflat, ts, flat, **verify_kw)
                return ts, ds, vflat

            def draft_phase(args):
                ts, ds = args
                return ts, grow(dflat, ds, n=d, **grow_kw), jnp.zeros((vsize,), jnp.int32)

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
        init = (ts, ds, snap, flat, jnp.zeros((), bool), jnp.zeros((), jnp.int32))
        ts, ds, _, _, _, it = jax.lax.while_loop(lambda c: ~c[4] & (c[5] < limit), body, init)
        return jax.tree.map(lambda x: x[None], (ts, ds, it))

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=PartitionSpec(),
        out_specs=PartitionSpec(AXIS),
        check_vma=False,
    )(tflat, dflat, ts, ds, snap, flat)


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


def run(
    tdev,
    ddev,
    tflat,
    dflat,
    ts,
    ds,
    snap,
    flat,
    *,
    verify_kw,
    grow_kw,
    next_kw,
    d,
    vlayout,
    sources,
):
    """Run the loop from the first snapshot: (target state, draft state, iterations, seconds of
    setup: the weights' copy on a first call and the compile, once per shape)."""
    mesh = Mesh([tdev, ddev], (AXIS,))
    t0 = time.perf_counter()
    tflat, dflat = replicate_weights(mesh, tflat, dflat, sources)
    setup_s = time.perf_counter() - t0
    # the states' copies are this call's own work: not setup
    states = jax.device_put((ts, ds, snap, flat), NamedSharding(mesh, PartitionSpec()))
    t0 = time.perf_counter()
    static = dict(
        mesh=mesh,
        verify_kw=tuple(sorted(verify_kw.items())),
        grow_kw=tuple(sorted(grow_kw.items())),
        next_kw=tuple(sorted(next_kw.items())),
        d=d,
        vlayout=vlayout,
    )
    exe, _ = compiled(device_loop, tflat, dflat, *states, **static)
    setup_s += time.perf_counter() - t0
    ts, ds, it = exe(tflat, dflat, *states)
    first, second = (lambda x: x[0]), (lambda x: x[1])
    return jax.tree.map(first, ts), jax.tree.map(second, ds), int(it[0]), setup_s
