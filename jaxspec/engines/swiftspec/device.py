"""SwiftSpec's iteration as one XLA program over both devices (``loop="device"``, 1 + 1 layouts).

The threaded loop (``threads.ThreadLoop``) hands every verdict and snapshot through
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
(0.75x); it was reverted (git show 785ba73:benchmarks/notes/swiftspec_2gpu_loops.md).

The program also makes the states (the target's prefill on its device, the draft's first tree
and snapshot on its own) and returns only the tokens and counters: on two H200s (422a005) the
first version, which copied the prefilled states onto both devices and returned both whole,
spent ~170 ms a call in those copies and per-leaf slicing (9.6 ms an iteration over 47, against
a steady 6.07 in its trace; benchmarks/notes/swiftspec_2gpu.md).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.engines import programs
from jaxspec.engines.swiftspec import workers as W
from jaxspec.errors import WorkerError

AXIS = "w"


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


@dataclasses.dataclass(frozen=True)
class Loop:
    """The device loop's static program: the workers' and the two-device mesh."""

    prog: W.Program
    mesh: Mesh


def device_loop(static: Loop, tflat, dflat, ids, lens, seed):
    """The whole generation: ``(tflat, dflat, ids, lens, seed) -> results``, every argument
    replicated on the mesh (target device first, draft device second). The states are made in
    the program (the target's prefill, the draft's first tree and snapshot), so no state crosses
    between the host and the mesh; the results are the target's tokens and the counters the
    engine reports, each stacked over the two devices."""
    prog, d = static.prog, static.prog.d

    def per_device(tflat, dflat, ids, lens, seed):
        me = jax.lax.axis_index(AXIS)
        ts, first = _branch(me, 0, lambda *a: W.target_prefill(prog, *a), tflat, ids, lens, seed)
        first = jnp.where(me == 0, first, jax.lax.ppermute(first, AXIS, [(0, 1)]))

        def start(dflat, ids, lens, first):
            ds = W.draft_init(prog, dflat, ids, lens, first)
            ds = W.draft_grow((prog, d), dflat, ds)
            return (ds, *W.draft_snapshot(prog, ds))

        ds, snap, flat = _branch(me, 1, start, dflat, ids, lens, first)
        flat = jnp.where(me == 0, jax.lax.ppermute(flat, AXIS, [(1, 0)]), flat)
        vshapes = jax.eval_shape(lambda *a: W.target_verify(prog, *a), tflat, ts, flat)[2]

        def body(c):
            ts, ds, snap, flat, _, it = c

            def target_phase(args):
                ts, ds = args
                ts, _, vflat = W.target_verify(prog, tflat, ts, flat)
                return ts, ds, vflat

            def draft_phase(args):
                ts, ds = args
                return ts, W.draft_grow((prog, d), dflat, ds), _zeros(vshapes)

            ts, ds, vflat = jax.lax.cond(me == 0, target_phase, draft_phase, (ts, ds))
            vflat = jnp.where(me == 0, vflat, jax.lax.ppermute(vflat, AXIS, [(0, 1)]))

            def reroot(args):
                ds, snap = args
                ds, snap, new, _ = W.draft_next(prog, dflat, ds, snap, vflat)
                return ds, snap, new

            def wait(args):
                ds, snap = args
                return ds, snap, jnp.zeros_like(flat)

            ds, snap, new = jax.lax.cond(me == 1, reroot, wait, (ds, snap))
            flat = jnp.where(me == 0, jax.lax.ppermute(new, AXIS, [(1, 0)]), new)
            done = W.unpack(vflat, prog.verdict_layout).done
            return ts, ds, snap, flat, done, it + 1

        # every verification emits a token per live row, so max_new of them finish any run: the
        # bound only keeps a wrong verdict from spinning forever (nothing hangs)
        limit = ts.out.tokens.shape[1]
        init_c = (ts, ds, snap, flat, jnp.zeros((), bool), jnp.zeros((), jnp.int32))
        ts, ds, _, _, _, it = jax.lax.while_loop(lambda c: ~c[4] & (c[5] < limit), body, init_c)
        results = dict(
            out=ts.out.tokens, count=ts.out.count, done=ts.out.done, emitted=ts.out.emitted,
            live_steps=ts.out.live_steps, carried=ds.carried, recomputed=ds.recomputed, it=it,
        )  # fmt: skip
        return jax.tree.map(lambda x: x[None], results)

    return jax.shard_map(
        per_device,
        mesh=static.mesh,
        in_specs=PartitionSpec(),
        out_specs=PartitionSpec(AXIS),
        check_vma=False,
    )(tflat, dflat, ids, lens, seed)


def replicated(setup, mesh: Mesh) -> tuple[list, list]:
    """Both workers' weights on both devices (one program runs on both; each touches only its
    own): for Llama-3-8B and 3.2-1B, 16 GB more on the draft's device. The copy is kept with
    the placed target model, for its next call with the same draft weights, and goes with it."""
    key = ("swiftspec-replicated", mesh)
    kept = setup.target._cache.get(key)
    if kept is None or kept[0] is not setup.draft.weights:
        rep = jax.device_put(
            (setup.target.flat, setup.draft.flat), NamedSharding(mesh, PartitionSpec())
        )
        kept = setup.target._cache[key] = (setup.draft.weights, jax.block_until_ready(rep))
    return kept[1]


def _unfused(net):
    return net.with_kernels(net.kernels.resolve(net.cfg, sharded=True))


def run(prog: W.Program, setup, ids, lens, seed, stats, progress=None) -> dict:
    """The whole generation on the two devices. Its setup (``stats.setup_s``: the weights' copy
    on a first call and the compile, once per shape) is not in ``wall_s``, as compiles never
    are. Returns the results, each the target's or the draft's as fits."""
    tdev = next(iter(setup.on_t.device_set))
    ddev = next(iter(setup.on_d.device_set))
    mesh = Mesh(np.array([tdev, ddev]), (AXIS,))
    t0 = time.perf_counter()
    tflat, dflat = replicated(setup, mesh)
    # a few token ids and a seed: the only inputs that are this call's own
    args = jax.device_put((ids, lens, np.uint32(seed)), NamedSharding(mesh, PartitionSpec()))
    # the arrays span both devices: the fused kernels (no partitioning rule) stay out
    unfused = dataclasses.replace(
        prog,
        target=_unfused(prog.target),
        draft=dataclasses.replace(prog.draft, net=_unfused(prog.draft.net)),
    )
    static = Loop(unfused, mesh)
    key = (setup.target.layout, setup.draft.layout, programs.shapes_key(ids, lens))
    exe, _ = programs.compiled(
        device_loop, static, (tflat, dflat, *args), key, progress=progress,
        what="swiftspec's two-device loop",
    )  # fmt: skip
    setup_s = time.perf_counter() - t0
    res = jax.device_get(exe(tflat, dflat, *args))
    res = {k: v[0] if k in ("out", "count", "done", "emitted", "live_steps", "it") else v[1]
           for k, v in res.items()}  # fmt: skip
    stats.compile_s += setup_s
    stats.setup_s = setup_s
    it = int(res["it"])
    if not bool(res["done"].all()):
        raise WorkerError(
            f"the on-device loop stopped after {it} verifications with rows unfinished (a "
            "verdict never said done). Both workers were stopped."
        )
    d = prog.d
    stats.verify_steps += it
    stats.draft_expansions += d * (it + 1)  # + the first snapshot's
    stats.expansions_in_flight += d * it  # phase 1: the d grows run beside the verify
    return res
