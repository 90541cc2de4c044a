"""SwiftSpec's profile: measure the workers, pick the device split and d.

For each split (x target devices, y draft devices) the machine allows, the engine's own program
(``SwiftSpec.program``: both models placed on their meshes) and workers (``workers``) time one
target verify of ``bs`` tree nodes, one draft expansion of ``w`` leaves, and the two handoffs,
at the real prompt length. SwiftSpec's iteration takes about ``max(t_verify, d * t_draft +
handoff)``; d expansions add about ``d * w * k`` nodes, of which the target sees the best bs. We
pick d = round((t_verify - handoff) / t_draft) (at least 1): the most draft work that still
hides behind the verify, so deeper trees cost no time, and the split with the smallest iteration
time (acceptance is a property of the models, the same for every split).

The target's verify on x devices runs the tensor-parallel form its kernels name (``Profile.
tensor_parallel``: KernelConfig(tensor_parallel="shard_map") for the explicit step), so the
choice rests on the scaling measured here, ``tp_scaling``: t_verify on one device over t_verify on
x, which on two H200s through GSPMD was below 1 (benchmarks/notes/gpu_decode.md).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxspec.engines import base, programs
from jaxspec.engines.swiftspec import engine as sw
from jaxspec.engines.swiftspec import workers as W
from jaxspec.model import sharding
from jaxspec.spec.sampling import Sampling
from jaxspec.timing import median_ms

PROFILE_DEPTH = 8  # the tree's room while profiling: deep enough that a snapshot is bs nodes


@dataclasses.dataclass(frozen=True)
class Profile:
    target_devices: int
    draft_devices: int
    t_verify_ms: float
    t_draft_ms: float
    handoff_ms: float
    d: int
    tensor_parallel: str = ""  # the target's form on x > 1 devices: "gspmd" / "shard_map"

    @property
    def iteration_ms(self) -> float:
        return max(self.t_verify_ms, self.d * self.t_draft_ms + self.handoff_ms)


def _exe(fn, static, *args):
    exe, _ = programs.compiled(fn, static, args, _key(args))
    return exe


def _key(args) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple(
        (np.shape(x), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None))
        for x in leaves
    )


def measure(
    target, draft, prompt: list[int], split: tuple[int, int], *, width=8, branch=4, bs=8,
    reps=10, kernels=None,
) -> Profile:  # fmt: skip
    """Time the SwiftSpec workers for one split (devices [0, x) and [x, x + y))."""
    x, y = split
    ids = np.asarray([prompt], np.int32)
    lens = np.asarray([len(prompt)], np.int32)
    cap = 2 * reps + 64
    req = base.Request(1, ids.shape[1], cap, Sampling(), ())
    opts = sw.Options(depth=PROFILE_DEPTH // 2, width=width, branch=branch, bs=bs,
                      target_devices=x, draft_devices=y, loop="threads")  # fmt: skip
    prog, setup = sw.ENGINE.program(target, draft, opts, req, kernels)
    wp = prog.workers
    tflat, dflat, on_t, on_d = setup.target.flat, setup.draft.flat, setup.on_t, setup.on_d
    ids_t, lens_t = jax.device_put(ids, on_t), jax.device_put(lens, on_t)
    seed = jax.device_put(np.uint32(0), on_t)
    ts, first = _exe(W.target_prefill, wp, tflat, ids_t, lens_t, seed)(tflat, ids_t, lens_t, seed)
    ids_d, lens_d, first_d = (jax.device_put(a, on_d) for a in (ids, lens, first))
    ds = _exe(W.draft_init, wp, dflat, ids_d, lens_d, first_d)(dflat, ids_d, lens_d, first_d)
    grow = _exe(W.draft_grow, (wp, 1), dflat, ds)
    box = {"ds": ds}

    def expand():
        box["ds"] = grow(dflat, box["ds"])
        return box["ds"].tree.size

    t_draft = median_ms(expand, reps)
    snap, flat = _exe(W.draft_snapshot, wp, box["ds"])(box["ds"])
    flat_t = jax.device_put(flat, on_t)
    verify = _exe(W.target_verify, wp, tflat, ts, flat_t)
    tbox = {"ts": ts}

    def one_verify():
        tbox["ts"], v, tbox["v"] = verify(tflat, tbox["ts"], flat_t)
        return v.n

    t_verify = median_ms(one_verify, reps)
    # the engine's handoffs: the packed snapshot to the target, the packed verdict back
    handoff = median_ms(lambda: jax.device_put(flat, on_t), reps) + median_ms(
        lambda: jax.device_put(tbox["v"], on_d), reps
    )
    d = max(1, round((t_verify - handoff) / t_draft))
    form = wp.target.kernels.tensor_parallel if x > 1 else ""
    return Profile(x, y, t_verify, t_draft, handoff, d, form)


def tp_scaling(profiles: list[Profile]) -> dict[int, float]:
    """How much faster the target verifies on x devices than on one (t_verify(1) / t_verify(x),
    the fastest of the splits with x target devices); {} without a one-device profile."""
    best: dict[int, float] = {}
    for p in profiles:
        best[p.target_devices] = min(best.get(p.target_devices, float("inf")), p.t_verify_ms)
    if 1 not in best:
        return {}
    return {x: round(best[1] / t, 3) for x, t in sorted(best.items())}


def splits(target_cfg, draft_cfg, n_devices: int) -> list[tuple[int, int]]:
    """Every (x, y) with x + y <= n whose degrees divide both models' split dimensions."""
    out = []
    for x in sharding.valid_tp_degrees(target_cfg, limit=n_devices - 1):
        for y in sharding.valid_tp_degrees(draft_cfg, limit=n_devices - x):
            out.append((x, y))
    return out


def profile(
    target, draft, prompt: list[int], *, width=8, branch=4, bs=8, reps=10, progress=None,
    kernels=None,
) -> list[Profile]:  # fmt: skip
    """Profiles of every split, best (smallest iteration time) first."""
    n = len(jax.devices())
    dm = sw.draft_model(target, draft)
    sw.split_devices(target.config, dm.config, None, None)  # one device: says what to do
    results = []
    for split in splits(target.config, dm.config, n):
        results.append(
            measure(
                target,
                draft,
                prompt,
                split,
                width=width,
                branch=branch,
                bs=bs,
                reps=reps,
                kernels=kernels,
            )  # fmt: skip
        )
        if progress:
            progress(results[-1])
    return sorted(results, key=lambda p: p.iteration_ms)


def tune(target, draft, options: sw.Options, ids, lens, req, kernels, progress=None):
    """SwiftSpec's open choices: the split (when neither side is given: the best of every split,
    measured once per draft and prompt-length bucket and kept with the target model) and d
    (from that split's profile). Returns (options with both, what was chosen and measured)."""
    dm = sw.draft_model(target, draft)
    x, y = options.target_devices, options.draft_devices
    kw = dict(width=options.width, branch=options.branch, bs=options.bs, kernels=kernels)
    prompt = [int(t) for t in ids[0, : int(lens[0])]]
    if x is None and y is None:
        # kept with the draft's model (the target itself for a self-draft): times depend on
        # the target and that draft only
        key = ("swiftspec-profile", target.layout, len(prompt) // 256, tuple(sorted(kw.items())))
        every = dm._cache.get(key)
        if every is None:
            if progress:
                progress("profiling SwiftSpec's workers on every device split")
            probe = [int(target.config.bos_token_id or 1)] * max(len(prompt), 1)
            every = dm._cache[key] = profile(target, draft, probe, **kw)
        best = every[0]
    else:
        tdev, ddev = sw.split_devices(target.config, dm.config, x, y)
        best = measure(target, draft, prompt, (len(tdev), len(ddev)), **kw)
        every = [best]
    depth = options.depth if options.depth is not None else best.d
    new = dataclasses.replace(
        options, target_devices=best.target_devices, draft_devices=best.draft_devices,
        depth=depth,
    )  # fmt: skip
    return new, {
        "chosen": {
            "target_devices": best.target_devices,
            "draft_devices": best.draft_devices,
            "d": depth,
        },  # fmt: skip
        "stats": {"profiled": dataclasses.asdict(best), "tp_scaling": tp_scaling(every)},
    }
