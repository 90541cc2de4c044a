"""SwiftSpec's profile: measure the workers, pick the device split and d.

For each split (x target devices, y draft devices) the machine allows, time one target verify of
``bs`` tree nodes, one draft expansion of ``w`` leaves, and the two handoffs, on the real
models and prompt length. SwiftSpec's iteration takes about ``max(t_verify, d * t_draft +
handoff)``; d expansions add about ``d * w * k`` nodes, of which the target sees the best bs.
We pick d = round((t_verify - handoff) / t_draft) (at least 1): the most draft work that still
hides behind the verify, so deeper trees cost no time, and the split with the smallest
iteration time (acceptance is a property of the models, the same for every split).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxspec.engines.base import compiled, pad_prompts
from jaxspec.spec.sampling import Sampling
from jaxspec.timing import median_ms


@dataclasses.dataclass(frozen=True)
class Profile:
    target_devices: int
    draft_devices: int
    t_verify_ms: float
    t_draft_ms: float
    handoff_ms: float
    d: int

    @property
    def iteration_ms(self) -> float:
        return max(self.t_verify_ms, self.d * self.t_draft_ms + self.handoff_ms)


def measure(
    target, draft, prompt: list[int], split: tuple[int, int], *, width=8, branch=4, bs=8, reps=10
) -> Profile:
    """Time the SwiftSpec workers for one split (devices [0, x) and [x, x + y))."""
    from jaxspec.engines.swiftspec import engine as sw
    from jaxspec.engines.tree import TreeShape
    from jaxspec.spec import tree_drafts

    x, y = split
    devices = jax.devices()
    shape = TreeShape(depth=8, width=width, branch=branch, bs=bs)
    dr, dparams = tree_drafts.resolve(target, draft, capacity=shape.capacity)
    dr = dataclasses.replace(dr, reuse_target_cache=False)
    tparams, tmesh = sw.place(target.params, target.config, devices[:x])
    dparams, dmesh = sw.place(dparams, dr.cfg, devices[x : x + y])
    on_t, on_d = NamedSharding(tmesh, PartitionSpec()), NamedSharding(dmesh, PartitionSpec())
    tflat, tptree = jax.tree.flatten(tparams)
    dflat, dptree = jax.tree.flatten(dparams)
    ids, lens = pad_prompts([prompt])
    cap = ids.shape[1] + 2 * reps + 64 + shape.capacity * 2
    s = Sampling()
    ts, first = sw.target_prefill(
        tflat,
        jax.device_put(ids, on_t),
        jax.device_put(lens, on_t),
        jax.device_put(jax.random.key(0), on_t),
        ptree=tptree,
        graphdef=target.graphdef,
        cfg=target.config,
        max_new=cap,
        capacity=cap,
        sampling=s,
        eos=(),
    )
    grow = dict(ptree=dptree, draft=dr, width=width, branch=branch, n=1)
    box = {
        "ds": sw.draft_init(
            dflat,
            jax.device_put(ids, on_d),
            jax.device_put(lens, on_d),
            jax.device_put(first, on_d),
            ptree=dptree,
            draft=dr,
            capacity=cap,
        )
    }

    # Executables compiled once and called directly: a jit call re-hashes its static
    # arguments (an NNX graphdef: milliseconds) every time, which the engine never pays.
    grow_exe, _ = compiled(sw.draft_grow, dflat, box["ds"], **grow)

    def expand():
        box["ds"] = grow_exe(dflat, box["ds"])
        return box["ds"].tree.size

    t_draft = median_ms(expand, reps)
    snap, flat = sw.draft_snapshot(box["ds"], bs=bs)
    flat_t = jax.device_put(flat, on_t)
    tbox = {"ts": ts}
    kw = dict(ptree=tptree, graphdef=target.graphdef, sampling=s, eos=(), layout=sw.spec(snap))
    verify_exe, _ = compiled(sw.target_verify, tflat, ts, flat_t, **kw)

    def verify():
        tbox["ts"], v, tbox["v"] = verify_exe(tflat, tbox["ts"], flat_t)
        return v.n

    t_verify = median_ms(verify, reps)
    # the engine's handoffs: the packed snapshot to the target, the packed verdict back
    handoff = median_ms(lambda: jax.device_put(flat, on_t), reps) + median_ms(
        lambda: jax.device_put(tbox["v"], on_d), reps
    )
    d = max(1, round((t_verify - handoff) / t_draft))
    return Profile(x, y, t_verify, t_draft, handoff, d)


def splits(target_cfg, draft_cfg, n_devices: int) -> list[tuple[int, int]]:
    """Every (x, y) with x + y <= n whose degrees divide both models' split dimensions."""
    from jaxspec.model.sharding import valid_tp_degrees

    tx = valid_tp_degrees(target_cfg, limit=n_devices - 1)
    out = []
    for x in tx:
        for y in valid_tp_degrees(draft_cfg, limit=n_devices - x):
            out.append((x, y))
    return out


def profile(
    target, draft, prompt: list[int], *, width=8, branch=4, bs=8, reps=10, progress=None
) -> list[Profile]:
    """Profiles of every split, best (smallest iteration time) first."""
    from jaxspec.errors import DeviceError

    n = len(jax.devices())
    if n < 2:
        raise DeviceError(
            "profiling SwiftSpec needs 2+ devices (target and draft on separate "
            "ones); this machine has 1."
        )
    cfg_d = draft.config if hasattr(draft, "config") else target.config
    results = []
    for split in splits(target.config, cfg_d, n):
        results.append(
            measure(target, draft, prompt, split, width=width, branch=branch, bs=bs, reps=reps)
        )
        if progress:
            progress(results[-1])
    return sorted(results, key=lambda p: p.iteration_ms)


_CACHE: dict = {}


def cached_profile(target, draft, prompt_len: int, **kw) -> Profile:
    """The best split for these models (measured once per process and prompt-length bucket)."""
    key = (id(target), id(draft), prompt_len // 256, tuple(sorted(kw.items())))
    if key not in _CACHE:
        prompt = [int(target.config.bos_token_id or 1)] * max(prompt_len, 1)
        _CACHE[key] = profile(target, draft, prompt, **kw)[0]
    return _CACHE[key]
