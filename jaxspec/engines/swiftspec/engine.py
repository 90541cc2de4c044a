"""SwiftSpec: asynchronous, disaggregated tree speculation over two device meshes.

The target lives on mesh A (devices [0, x), tensor-parallel over x), the draft on mesh B
([x, x + y), tensor-parallel over y). The workers (``workers``) run:

    snapshot_0 = best bs nodes of the draft's tree                    (mesh B)
    loop:
        verify snapshot_n                                             (mesh A, in flight)
        grow the draft tree d times (parallel tree generation; with max_extra, once more each
          time the draft is idle and another expansion fits in the verify's expected time)
        handoff: path, n, bonus -> mesh B   (a few ids, packed into one array)
        re-root the *grown* tree on the verified path (evolving tree cache: verified KV to the
          prefix, the bonus token's subtree kept -- including nodes grown during the verify --
          dead branches dropped, nothing recomputed); take snapshot_{n+1} at once

The critical path of an iteration is verify -> handoff -> re-root + snapshot -> verify: no draft
expansion is on it. When the bonus token is not in the tree, the next snapshot is that token
alone (a one-token verify, like a decode step) while the draft grows its new tree behind the
verify; waiting for ``refill`` expansions first (an option, default 0) puts them back on the
critical path, which measured 1.6x slower on two H200s (benchmarks/RESULTS.md, SwiftSpec).

Two loops drive the workers: ``loop="threads"`` (``threads``: one host thread per worker, each
waiting only for the other's handoff) and ``loop="device"`` (``device``: 1 + 1 layouts, the
whole generation as one program over both devices with device-to-device handoffs). The split
(x, y) and d are open choices when not given: ``jaxspec.generate`` hands them to SwiftSpec's
profile (``measure.split``), which times these same workers on every split. Exactness is the
tree engine's: ``accept_tree`` is lossless for any snapshot.

A self-draft (``"self-streaming"``) runs the target's weights with a StreamingLLM cache on mesh
B; it prefills there itself (the target's cache is on the other mesh), and its sparse tree cache
re-roots like a dense one, so the tree grown during a verify survives.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxspec.engines import base
from jaxspec.engines.swiftspec import device, threads, workers
from jaxspec.engines.tree import TreeShape
from jaxspec.errors import DeviceError, DraftError, OptionError, WorkerError
from jaxspec.model import sharding
from jaxspec.model.feature_head import FeatureModel
from jaxspec.model.transformer import Model
from jaxspec.spec import tree_drafts

LOOPS = ("auto", "threads", "device")
# loop="auto" runs loop="device" for a 1 + 1 layout whose target weighs at least this many bytes
# (and no option only the threaded loop takes). On two H200s the device loop took 6.26 ms an
# iteration against 8.65 threaded for a Llama-3-8B-shape target (16 GB), but SmolLM2-135M (0.27
# GB) ran at 374 tok/s against 462 threaded (benchmarks/RESULTS.md, SwiftSpec): a short verify
# cannot hide the device loop's per-iteration control flow.
AUTO_DEVICE_BYTES = 2**30


@dataclasses.dataclass(frozen=True)
class Options(base.DraftOptions):
    """``depth``: d, expansions per verification (None: from the profile); ``target_devices`` /
    ``draft_devices``: the split (None: from the profile when both are open, else the most
    each model's heads allow); ``max_extra``, ``refill``, ``loop``: see the module docstring;
    ``observe``: a test hook called with (target state, draft state) after each re-root."""

    depth: int | None = None
    width: int = 8
    branch: int = 4
    bs: int = 8
    target_devices: int | None = None
    draft_devices: int | None = None
    max_extra: int = 0
    refill: int = 0
    loop: str = "auto"
    observe: object = None

    def __post_init__(self):
        base.positive_int("width", self.width, maximum=64)
        base.positive_int("branch", self.branch, maximum=16)
        base.positive_int("bs", self.bs, maximum=128)
        if self.depth is not None:
            base.positive_int("depth", self.depth, maximum=32)
        for name in ("target_devices", "draft_devices"):
            if getattr(self, name) is not None:
                base.positive_int(name, getattr(self, name))
        base.count_int("max_extra", self.max_extra)
        base.count_int("refill", self.refill)
        if self.loop not in LOOPS:
            raise OptionError(
                f"loop must be one of {', '.join(map(repr, LOOPS))}, got {self.loop!r}."
            )
        if self.loop == "device" and (self.max_extra or self.refill or self.observe is not None):
            raise OptionError(
                "loop='device' runs a fixed d expansions per verification on the device: it "
                "takes no max_extra, refill or observe; use loop='threads' for those."
            )


@dataclasses.dataclass(frozen=True)
class Program:
    workers: workers.Program
    split: tuple[int, int]
    loop: str
    max_extra: int


@dataclasses.dataclass
class Setup:
    """The run's data beside the static program: both models placed on their meshes."""

    target: Model  # on mesh A
    draft: Model  # on mesh B
    on_t: NamedSharding
    on_d: NamedSharding
    observe: object = None
    pace: threads.Pace | None = None


@dataclasses.dataclass
class SwiftSpecStats(base.TreeStats):
    verify_steps: int = 0
    draft_expansions: int = 0
    expansions_in_flight: int = 0
    refill_expansions: int = 0
    handoff_s: float = 0.0
    setup_s: float | None = None
    nodes_carried: int = 0
    tokens_recomputed: int = 0
    host_ms_per_iteration: dict | None = None
    target_devices: int = 0
    draft_devices: int = 0
    d: int = 0
    loop: str = ""
    profiled: dict | None = None


def split_devices(target_cfg, draft_cfg, x: int | None, y: int | None) -> tuple[list, list]:
    """Devices [0, x) for the target and [x, x + y) for the draft; a default fills None."""
    devices = jax.devices()
    if len(devices) < 2:
        raise DeviceError(
            "method='swiftspec' runs the target and the draft on separate devices and this "
            "machine has one. Use method='tree' (the same trees, serially) or run on 2+ devices "
            "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2 before importing jax)."
        )
    if x is None:
        x = max(sharding.valid_tp_degrees(target_cfg, limit=len(devices) - (y or 1)))
    if y is None:
        y = max(sharding.valid_tp_degrees(draft_cfg, limit=len(devices) - x) or [1])
    if x + y > len(devices):
        raise DeviceError(
            f"target_devices={x} + draft_devices={y} exceeds the {len(devices)} "
            "devices of this machine."
        )
    return devices[:x], devices[x : x + y]


# Why a feature draft (EAGLE) cannot serve here: it drafts from the target's hidden states at the
# last verified tokens, and SwiftSpec's draft grows the next tree while the target is still
# verifying the current one, so those states arrive only after the tree is grown.
FEATURE_DRAFT = (
    "method='swiftspec' drafts ahead of the verify, so a feature draft would never have the "
    "target's newest hidden states (they come with the verdict, after the next tree is grown); "
    "use method='tree' or 'chain' with a feature draft, or swiftspec with a draft Model."
)


def draft_model(target: Model, draft) -> Model:
    """The model the draft worker runs: a draft Model, or the target's weights for a self-draft.
    A feature draft is refused: it grows the tree on the target's newest states, which here are
    always a verify behind (see ``FEATURE_DRAFT``)."""
    if isinstance(draft, FeatureModel):
        raise DraftError(FEATURE_DRAFT)
    if draft == "ngram":
        raise DraftError(
            "method='swiftspec' needs a draft model (or 'self-streaming'); "
            "'ngram' has nothing to run on a second mesh: use method='tree'."
        )
    return draft if isinstance(draft, Model) else target


class SwiftSpec(base.Engine):
    name = "swiftspec"
    Options = Options

    def open_choices(self, options: Options) -> tuple[str, ...]:
        split = options.target_devices is None and options.draft_devices is None
        return (("split",) if split else ()) + (("depth",) if options.depth is None else ())

    def program(self, target, draft, options: Options, req, kernels):
        """The static program and the placed models for a split and depth both given (or
        chosen by ``measure.split``)."""
        if options.depth is None:
            raise OptionError(
                "swiftspec's depth (d) is chosen by its profile when open (jaxspec.generate does "
                "it through measure.split); pass depth to build a program directly."
            )
        dm = draft_model(target, draft)
        tdev, ddev = split_devices(
            target.config, dm.config, options.target_devices, options.draft_devices
        )
        d, max_extra = options.depth, options.max_extra
        # room for the levels a snapshot's tree holds (d) plus the d grown while it is verified,
        # plus the extra expansions: a full tree cannot grow during the verify
        shape = TreeShape(depth=2 * d + max_extra, width=options.width, branch=options.branch,
                          bs=options.bs)  # fmt: skip
        pt, on_t = sharding.place(target, tdev)
        pd, on_d = sharding.place(dm, ddev)
        td, _ = tree_drafts.resolve(
            target, draft, capacity=shape.capacity, depth=shape.depth, kernels=kernels,
            sharded=len(ddev) > 1, **options.draft_kwargs(),
        )  # fmt: skip
        td = dataclasses.replace(td, reuse_target_cache=False)  # the target's cache is on mesh A
        wp = workers.Program(
            target=pt.net(kernels, sharded=len(tdev) > 1), draft=td, shape=shape, req=req,
            capacity=req.width + req.max_new + shape.capacity + 2, d=d, refill=options.refill,
        )  # fmt: skip
        key = ("swiftspec-layouts", wp, pd.layout)  # tracing the workers' shapes costs ~20 ms
        if key not in pt._cache:
            ids = np.zeros((req.batch, req.width), np.int32)
            lens = np.ones((req.batch,), np.int32)
            pt._cache[key] = workers.with_layouts(wp, pt.flat, pd.flat, ids, lens)
        wp = pt._cache[key]
        loop = options.loop
        if loop == "device" and (len(tdev), len(ddev)) != (1, 1):
            raise OptionError(
                f"loop='device' runs one device per worker; this layout has {len(tdev)} + "
                f"{len(ddev)}. Pass target_devices=1, draft_devices=1, or use loop='threads'."
            )
        if loop == "auto":
            big = sum(x.nbytes for x in target.flat) >= AUTO_DEVICE_BYTES
            one_each = (len(tdev), len(ddev)) == (1, 1)
            threads_only = max_extra or options.refill or options.observe is not None
            loop = "device" if big and one_each and not threads_only else "threads"
        prog = Program(wp, (len(tdev), len(ddev)), loop, max_extra)
        return prog, Setup(pt, pd, on_t, on_d, options.observe)

    def stream(self, prog: Program, target, setup: Setup, ids, lens, seed, *, steps, progress=None):
        """SwiftSpec's loops keep the emitted tokens inside the target worker's state, handed
        from verify to verify: a stream yields them once, at the end."""
        r = self.run(prog, target, setup, ids, lens, seed, progress=progress)
        yield r.tokens, r.count
        return r

    def run(self, prog: Program, target, setup: Setup, ids, lens, seed, *, progress=None):
        stats = SwiftSpecStats()
        t0 = time.perf_counter()
        try:
            if prog.loop == "device":
                final = device.run(prog.workers, setup, ids, lens, seed, stats, progress)
            else:
                final = threads.run(
                    prog.workers, prog.max_extra, setup, ids, lens, seed, stats, progress
                )
        except WorkerError:
            raise
        except Exception as e:  # a fault in a transfer or a check: name it, never hang
            raise WorkerError(f"swiftspec failed outside a worker: {type(e).__name__}: {e}") from e
        wp = prog.workers
        stats.wall_s = time.perf_counter() - t0 - stats.compile_s
        stats.draft_expansions += stats.refill_expansions
        live = max(int(np.asarray(final["live_steps"]).sum()), 1)
        sh = wp.shape
        stats.target_steps = stats.verify_steps + 1
        stats.nodes_carried = int(np.asarray(final["carried"]).sum())
        stats.tokens_recomputed = int(np.asarray(final["recomputed"]).sum())
        stats.draft_steps = stats.draft_expansions
        stats.acceptance_length = float(np.asarray(final["emitted"]).sum()) / live
        stats.target_devices, stats.draft_devices = prog.split
        stats.d, stats.bs, stats.width, stats.branch = wp.d, sh.bs, sh.width, sh.branch
        stats.depth = sh.depth
        stats.loop = prog.loop
        return base.Run(np.asarray(final["out"]), np.asarray(final["count"]), stats)


ENGINE = base.register(SwiftSpec())
