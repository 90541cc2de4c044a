"""The time split of a decode run (``jaxspec bench``): draft, verify, handoff, prefill, host.

The engines run their whole decode loop on device (one jitted ``lax.while_loop``), so no host
timer sees inside it. Instead each component is timed in isolation with the engine's own units
(``Engine.units``, timed by ``measure.units``) on the very program the run compiled, and the
run's wall time is attributed as count x unit:

- **verify**: the engine's "verify" unit (chain: gamma + 1 tokens and the chain rule; tree: bs +
  1 nodes, the tree rule and the path commit; autoregressive: one decode step), times the loop's
  steps;
- **draft**: the engine's "draft" unit (chain: a propose of gamma tokens; tree: a grow of depth
  expansions), times the loop's steps; 0 for autoregressive;
- **handoff**: what the engine measured itself (SwiftSpec's transfers between meshes), else 0;
- **prefill**: the engine's ``init`` once (cache allocation, the target's prompt prefill, the
  draft's init or prefill): target work, not host overhead, so it gets its own part;
- **host**: the remainder, wall - the rest: loop control, bookkeeping outside the timed pieces,
  draft commits, dispatch and the final sync. When the parts exceed the wall (SwiftSpec's draft
  runs while the verify is in flight; timing noise elsewhere) host is clamped at 0 and the split
  says ``host_clamped`` and by how much (``overshoot_s``).

Units are timed with the caches at the run's middle context (prompt + max_new // 2, where a GPU
attention kernel's cost is its mean over the run: ``Engine.shifted``). Medians over ``reps``.
SwiftSpec's units come from its own profile (``measure.split``: one verify, one draft expansion,
on the run's split; the engine's own when it profiled itself).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

from jaxspec.measure import split
from jaxspec.measure import units as timed

PARTS = ("draft", "verify", "handoff", "prefill", "host")
HOW = (
    "component timings x counts: each of the engine's units (one draft step, one target verify "
    "or decode step) and its init (the prefill) timed in isolation on the run's own program "
    "(caches at prompt + max_new // 2; loop steps back to back on device; compile excluded; "
    "median), multiplied by the run's counts; handoff as measured by the engine; host = wall - "
    "the rest (loop control, bookkeeping, commits, dispatch), clamped at 0 with host_clamped"
)
METHOD = "component timings x counts"


@dataclasses.dataclass(frozen=True)
class Units:
    """Milliseconds of one of each component at one run shape."""

    rows: int
    prompt_width: int
    context: int  # the target cache length the step pieces were timed at (longest row)
    prefill_ms: float | None  # None: not measured (its time stays in host)
    draft_ms: float  # one loop step's draft work (swiftspec: one expansion)
    verify_ms: float  # one target verify (autoregressive: one decode step)
    draft_unit: str
    verify_unit: str
    measure_s: float  # seconds spent measuring, compiles included (outside every wall)

    def row(self) -> dict:
        return {
            "rows": self.rows,
            "prompt_width": self.prompt_width,
            "context": self.context,
            "prefill_ms": None if self.prefill_ms is None else round(self.prefill_ms, 4),
            "draft_ms": round(self.draft_ms, 4),
            "verify_ms": round(self.verify_ms, 4),
        }


# ---------------------------------------------------------------------------------------------
# attribution


def attribute(stats: Mapping, units: Units, method: str) -> dict:
    """Seconds per part of one run from its engine stats and the units at its shape."""
    wall = float(stats["wall_s"])
    if method == "swiftspec":
        draft = stats["draft_expansions"] * units.draft_ms / 1e3
        verify = stats["verify_steps"] * units.verify_ms / 1e3
    else:
        steps = int(stats["target_steps"]) - 1  # loop iterations after the prefill
        draft = 0.0 if method == "autoregressive" else steps * units.draft_ms / 1e3
        verify = steps * units.verify_ms / 1e3
    handoff = float(stats.get("handoff_s", 0.0))
    prefill = (units.prefill_ms or 0.0) / 1e3
    host = wall - draft - verify - handoff - prefill
    out = {"draft_s": draft, "verify_s": verify, "handoff_s": handoff, "prefill_s": prefill}
    out.update(host_s=max(host, 0.0), wall_s=wall, host_clamped=host < 0)
    if host < 0:
        out["overshoot_s"] = -host
    return out


def fractions(split: dict) -> dict:
    """Each part's share of the parts' sum (the wall, unless host was clamped)."""
    total = sum(split[f"{p}_s"] for p in PARTS)
    return {p: round(split[f"{p}_s"] / total, 4) if total > 0 else 0.0 for p in PARTS}


def summarize(splits: list[dict], units: list[Units], counts: dict) -> dict:
    """A method's split over its runs: summed seconds, shares, the units and counts used."""
    total = {f"{p}_s": sum(s[f"{p}_s"] for s in splits) for p in PARTS}
    total["wall_s"] = sum(s["wall_s"] for s in splits)
    out = {k: round(v, 6) for k, v in total.items()}
    out["fractions"] = fractions(total)
    out["host_clamped"] = any(s["host_clamped"] for s in splits)
    if out["host_clamped"]:
        out["overshoot_s"] = round(sum(s.get("overshoot_s", 0.0) for s in splits), 6)
    seen = list({id(u): u for u in units}.values())  # each shape's units once

    def named(field):  # one name, or each distinct one (MagicDec may pick per batch)
        names = list(dict.fromkeys(getattr(u, field) for u in seen))
        return " | ".join(names) if names else None

    out.update(
        method=METHOD,
        draft_unit=named("draft_unit"),
        verify_unit=named("verify_unit"),
        prefill_measured=all(u.prefill_ms is not None for u in seen),
        units_ms=[u.row() for u in seen],
        counts=counts,
        measure_s=round(sum(u.measure_s for u in seen), 3),
        how=HOW,
    )
    return out


# ---------------------------------------------------------------------------------------------
# per run


def shape_key(call) -> tuple:
    """What a run's units depend on: its program (models, draft, chosen shape) and inputs."""
    return (call.engine.name, call.prog, call.ids.shape)


def measure(call, *, reps: int = 3) -> Units:
    """The units of the run ``call`` (``GenerationResult.call``) at its shapes: each of the
    engine's units on the program the run compiled, and its ``init`` for the prefill."""
    t0 = time.perf_counter()
    engine, prog, ids, lens = call.engine, call.prog, call.ids, call.lens
    if engine.name == "swiftspec":
        u = _swiftspec(call, reps=reps)
    else:
        tflat = call.target.flat
        dflat = None if call.draft is None else call.draft.flat
        shift = prog.req.max_new // 2
        prefill = timed.init_ms(engine, prog, tflat, dflat, ids, lens, reps=reps)
        s = timed.initial(engine, prog, tflat, dflat, ids, lens, shift=shift)
        pieces = engine.units(prog)
        ms = {k: timed.unit_ms(u, prog, tflat, dflat, s, reps=reps) for k, u in pieces.items()}
        draft = pieces.get("draft")
        u = Units(
            rows=0, prompt_width=0, measure_s=0.0, context=int(lens.max()) + shift,
            prefill_ms=prefill, draft_ms=ms.get("draft", 0.0), verify_ms=ms["verify"],
            draft_unit="none" if draft is None else draft.what,
            verify_unit=pieces["verify"].what,
        )  # fmt: skip
    return dataclasses.replace(
        u, rows=ids.shape[0], prompt_width=ids.shape[1], measure_s=time.perf_counter() - t0
    )


def _swiftspec(call, *, reps) -> Units:
    """SwiftSpec's own profile: the engine's when it profiled itself, else one for this split."""
    stats = call.chosen.get("stats", {}) if call.chosen else {}
    p = stats.get("profiled")
    if p is None:
        prompt = [int(t) for t in call.ids[0, : int(call.lens[0])]]
        sh = call.prog.workers.shape
        prof = split.measure(
            call.target, call.draft_arg, prompt, call.prog.split, width=sh.width,
            branch=sh.branch, bs=sh.bs, reps=reps,
        )  # fmt: skip
        p = dataclasses.asdict(prof)
    return Units(
        rows=0, prompt_width=0, measure_s=0.0, context=int(call.lens.max()), prefill_ms=None,
        draft_ms=p["t_draft_ms"], verify_ms=p["t_verify_ms"],
        draft_unit="one draft expansion (swiftspec workers.draft_grow, n=1)",
        verify_unit="one target verify of the bs-node snapshot (workers.target_verify)",
    )  # fmt: skip


__all__ = ["HOW", "METHOD", "PARTS", "Units", "attribute", "fractions", "measure", "shape_key",
           "summarize"]  # fmt: skip
