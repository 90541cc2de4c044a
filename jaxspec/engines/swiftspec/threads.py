"""SwiftSpec's threaded loop (``loop="threads"``): one host thread per worker, each dispatching
to its own mesh and waiting only for the other worker's handoff (``ThreadLoop``), with the
pacing of extra expansions (``Pace``) and the host-time accounting (``Laps``)."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import distributed
from jaxspec.engines import programs
from jaxspec.engines.swiftspec import workers as W
from jaxspec.errors import WorkerError


class Calls:
    """The workers' executables for one run: each compiled once (``programs.compiled``, keyed by
    the program and its arguments' shapes; the compile seconds go to ``stats.compile_s``, out
    of ``wall_s``), then found by function and static program: an identity-cheap lookup, since
    the program's hash is computed once."""

    def __init__(self, stats, progress=None):
        self.stats, self.progress = stats, progress
        self.exes: dict = {}
        self.lock = threading.Lock()

    def __call__(self, name: str, fn, static, *args):
        try:
            exe = self.exes.get((fn, static))
            if exe is None:
                with self.lock:
                    exe, compile_s = programs.compiled(
                        fn, static, args, _shapes(args), progress=self.progress,
                        what=f"swiftspec's {name} worker ({getattr(fn, '__name__', fn)})",
                    )  # fmt: skip
                    self.stats.compile_s += compile_s
                    self.exes[(fn, static)] = exe
            return exe(*args)
        except Exception as e:
            raise WorkerError(
                f"the {name} worker failed in {getattr(fn, '__name__', fn)}: "
                f"{type(e).__name__}: {e}. Both workers were stopped."
            ) from e


def _shapes(args) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple(
        (np.shape(x), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None))
        for x in leaves
    )


def checked(v: W.Verdict, bs: int) -> bool:
    """Whether every row is done, after checking the verdict's values (on the host)."""
    n = np.asarray(v.n)
    nxt = np.asarray(v.next)
    if n.min() < 0 or n.max() > bs or nxt.min() < 0:
        raise WorkerError(
            f"the target worker returned an invalid verdict (accepted {n.tolist()}, "
            f"next {nxt.tolist()}). Both workers were stopped."
        )
    return bool(np.asarray(v.done))


@dataclasses.dataclass
class Pace:
    """When one more draft expansion may start while a verify is in flight: only when the draft
    is idle (never queue work the verdict would wait behind) and the expansion is expected to
    end before the verdict. Expected times (seconds): the profile's, then what this run sees
    (dispatch to ready, polled; ``None`` until seen: optimistic)."""

    verify: float | None = None
    draft: float | None = None
    poll_s: float = 50e-6
    _t: float | None = None  # when the last single expansion was dispatched

    def dispatched(self):
        self._t = time.perf_counter()

    def another_fits(self, verdict_ready, ds, t0: float) -> bool:
        """Wait until the verdict (``verdict_ready()``) or the draft is ready: False once the
        verdict is, else whether an expansion started now should end before it."""
        while True:
            now = time.perf_counter()
            if verdict_ready():
                self.verify = _mean(self.verify, now - t0)
                self._t = None
                return False
            if ds.tree.size.is_ready():
                if self._t is not None:
                    self.draft, self._t = _mean(self.draft, now - self._t), None
                if self.verify is None or self.draft is None:
                    return True
                return now - t0 + self.draft <= self.verify
            time.sleep(self.poll_s)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else 0.5 * (old + new)


class Laps:
    """Host seconds spent in each phase of the loop (dispatches, transfers, waits): where the
    host's share of an iteration goes. ``lap(name)`` charges the time since the last lap."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str | None = None) -> float:
        now = time.perf_counter()
        if name is not None:
            self.total[name] = self.total.get(name, 0.0) + now - self._t
        self._t = now
        return now

    def per_lap_ms(self, n: int) -> dict[str, float]:
        return {k: round(v / n * 1e3, 4) for k, v in self.total.items()}


_STOP = object()


@dataclasses.dataclass
class ThreadLoop:
    """The iteration loop on two host threads, one per worker: a dispatch that consumes a
    cross-device copy blocks its thread until the copy's source is ready (measured on two
    H200s: 7 ms of a 14.7 ms iteration inside the verify dispatch), so with one thread each
    mesh's work waited on the other's. Each thread blocks only on its own inputs:

        target: snapshot n (packed, on mesh A) -> verify -> verdict n to the draft thread
        draft:  grow d while verify n runs -> verdict n -> re-root + snapshot n+1 -> target

    A fault in either thread stops both (a stop marker in both queues) and is raised by the
    caller's thread; nothing waits forever."""

    prog: W.Program
    setup: object  # engine.Setup
    stats: object  # engine.SwiftSpecStats
    calls: Calls
    max_extra: int
    pace: Pace

    def run(self, ts, ds, snap, flat):
        self.to_target, self.to_draft = queue.Queue(), queue.Queue()
        self.finished = threading.Event()
        self.errors: list[BaseException] = []
        self.laps = {"target": Laps(), "draft": Laps()}
        self.refills: list = []
        self.spans = distributed.spans(self.setup.on_t, self.setup.on_d)
        with programs.Timer() as h:
            self.to_target.put((distributed.transfer(flat, self.setup.on_t), None))
        self.stats.handoff_s += h.s
        box = {"ts": ts, "ds": ds}
        workers = [
            threading.Thread(target=self._guard, args=(self._target, box), daemon=True),
            threading.Thread(target=self._guard, args=(self._draft, box, snap), daemon=True),
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if self.errors:
            e = self.errors[0]
            if isinstance(e, WorkerError):
                raise e
            raise WorkerError(f"swiftspec failed outside a worker: {type(e).__name__}: {e}") from e
        n = max(self.stats.verify_steps, 1)
        self.stats.host_ms_per_iteration = {
            f"{who}.{k}": v
            for who, laps in self.laps.items()
            for k, v in laps.per_lap_ms(n).items()
        }
        # summed on the draft's mesh, read with the results (no host read per iteration)
        refills = sum(self.refills, start=jnp.zeros((), jnp.int32, device=self.setup.on_d))
        return box["ts"], box["ds"], refills

    def _guard(self, fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # stop the other thread too, then report
            self.errors.append(e)
        finally:
            self.finished.set()
            self.to_target.put(_STOP)
            self.to_draft.put(_STOP)

    def _target(self, box):
        clock, previous, ts = self.laps["target"], None, box["ts"]
        tflat = self.setup.target.flat
        while True:
            clock.lap()
            msg = self.to_target.get()
            if msg is _STOP:
                return
            flat_t, seen = msg  # seen: the previous verdict as the draft's mesh received it
            clock.lap("wait_snapshot")
            ts, verdict, vflat = self.calls("target", W.target_verify, self.prog, tflat, ts, flat_t)
            box["ts"] = ts
            self.stats.verify_steps += 1
            self.to_draft.put((ts, verdict, vflat))
            clock.lap("verify")
            # the previous verdict (finished: this verify waited for it) says whether to stop
            if previous is not None and self._done(previous, seen):
                self.stats.verify_steps -= 1  # this verify only re-ran finished rows
                return
            clock.lap("check")
            previous = verdict

    def _draft(self, box, snap):
        clock, ds, stats, prog = self.laps["draft"], box["ds"], self.stats, self.prog
        dflat, d = self.setup.draft.flat, prog.d
        while True:
            clock.lap()
            # parallel tree generation: d expansions while verify n is in flight
            ds = self.calls("draft", W.draft_grow, (prog, d), dflat, ds)
            box["ds"] = ds
            stats.draft_expansions += d
            t_grow = clock.lap("grow")
            for _ in range(self.max_extra):
                if not self.pace.another_fits(self._verdict_ready, ds, t_grow):
                    break
                ds = self.calls("draft", W.draft_grow, (prog, 1), dflat, ds)
                box["ds"] = ds
                self.pace.dispatched()
                stats.draft_expansions += 1
                stats.expansions_in_flight += 1
            clock.lap("extra")
            msg = self.to_draft.get()
            # a finished target is news only in this process: across processes the last
            # verdict's handoffs (collectives) are made in every process, or they deadlock
            if msg is _STOP or (self.finished.is_set() and not self.spans):
                return
            ts, verdict, vflat = msg
            # counted, not timed: the verdict was not ready when the draft took it, so the
            # d expansions dispatched before were made while the verify was in flight
            stats.expansions_in_flight += d * (not verdict.n.is_ready())
            clock.lap("wait_verdict")
            with programs.Timer() as h:
                v = distributed.transfer(vflat, self.setup.on_d)
            ds, snap, flat, grown = self.calls("draft", W.draft_next, prog, dflat, ds, snap, v)
            box["ds"] = ds
            clock.lap("next")
            if self.setup.observe is not None:  # before the target may donate ts
                self.setup.observe(ts, ds)
            with programs.Timer() as h2:
                self.to_target.put((distributed.transfer(flat, self.setup.on_t), v))
            stats.handoff_s += h.s + h2.s
            clock.lap("put_snapshot")
            self.refills.append(grown)

    def _done(self, verdict: W.Verdict, seen) -> bool:
        """Whether the previous verdict says every row is done: read where the target's mesh
        is this process's, else from the copy the draft's mesh received (a process of a
        distributed job that holds only the draft's devices reads that one)."""
        if not verdict.n.addressable_shards:
            flat = distributed.local(seen)
            verdict = jax.tree.map(np.asarray, W.unpack(flat, self.prog.verdict_layout))
        return checked(verdict, self.prog.shape.bs)

    def _verdict_ready(self) -> bool:
        with self.to_draft.mutex:
            head = self.to_draft.queue[0] if self.to_draft.queue else None
        return head is _STOP or (head is not None and head[1].n.is_ready())


def run(prog: W.Program, max_extra: int, setup, ids, lens, seed, stats, progress=None) -> dict:
    """The whole generation on two host threads: the target's prefill, the draft's first tree
    and snapshot, then ``ThreadLoop``. Returns the target's tokens and the counters."""
    calls = Calls(stats, progress)
    on_t, on_d = setup.on_t, setup.on_d
    tflat, dflat = setup.target.flat, setup.draft.flat
    ts, first = calls(
        "target", W.target_prefill, prog, tflat, jax.device_put(ids, on_t),
        jax.device_put(lens, on_t), jax.device_put(np.uint32(seed), on_t),
    )  # fmt: skip
    ds = calls(
        "draft", W.draft_init, prog, dflat, jax.device_put(ids, on_d),
        jax.device_put(lens, on_d), distributed.transfer(first, on_d),
    )  # fmt: skip
    ds = calls("draft", W.draft_grow, (prog, prog.d), dflat, ds)
    stats.draft_expansions += prog.d
    snap, flat = calls("draft", W.draft_snapshot, prog, ds)
    loop = ThreadLoop(prog, setup, stats, calls, max_extra, setup.pace or Pace())
    ts, ds, refills = loop.run(ts, ds, snap, flat)
    final = distributed.fetch(  # every process gets them, wherever each mesh is
        dict(
            out=ts.out.tokens, count=ts.out.count, emitted=ts.out.emitted,
            live_steps=ts.out.live_steps, carried=ds.carried, recomputed=ds.recomputed,
            refills=refills,
        )
    )  # fmt: skip
    stats.refill_expansions = int(final.pop("refills"))
    return final
