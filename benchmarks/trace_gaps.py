"""Where devices sit idle: a profiler trace (``jax.profiler.trace``) as per-device busy time, the
largest idle gaps with the XLA modules on either side, and a timeline of module spans.

Used by ``bench_swiftspec_2gpu.py --trace`` (issue 4: is the async loop's iteration set by the
target's verify, the draft's work, or the gaps between them?).
``device_events`` reads the trace's GPU planes (a CPU trace has none); the summaries are pure
functions of event lists, so they are tested with made-up events.
"""

from __future__ import annotations

import collections
import glob

Event = tuple[int, int, str]  # (start ns, duration ns, name)
STAT_NAMES: list[str] = []  # the stats of the first kernel event ``device_events`` read


def gpu_planes(trace_dir: str) -> list:
    """The GPU planes of the newest trace under ``trace_dir`` (none without a trace, or in a CPU
    trace)."""
    from jax.profiler import ProfileData

    paths = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
    if not paths:
        return []
    return [p for p in ProfileData.from_file(paths[-1]).planes if p.name.startswith("/device:GPU")]


def stream_events(plane):
    """A GPU plane's events on its stream lines: its kernels and copies."""
    for line in plane.lines:
        if "Stream" in line.name:
            yield from line.events


def device_events(trace_dir: str) -> dict[str, dict[str, list[Event]]]:
    """Per GPU plane of the newest trace under ``trace_dir``: its XLA module spans
    (``"modules"``) and kernels (``"kernels"``, the stream lines).

    The module spans come from the plane's "XLA Modules" line where the trace has one; jax
    0.11.2's GPU traces have none (seen on two H200s), so they are otherwise rebuilt from each
    kernel's ``hlo_module`` stat (``spans_from_kernels``)."""
    out: dict[str, dict[str, list[Event]]] = {}
    for plane in gpu_planes(trace_dir):
        dev = out.setdefault(plane.name, {"modules": [], "kernels": []})
        tagged: list[Event] = []
        for line in plane.lines:
            if line.name == "XLA Modules":
                dev["modules"] += [(ev.start_ns, ev.duration_ns, ev.name) for ev in line.events]
        for ev in stream_events(plane):
            dev["kernels"].append((ev.start_ns, ev.duration_ns, ev.name))
            if not STAT_NAMES:  # what a kernel event carries (diagnosis)
                STAT_NAMES.extend(str(k) for k, _ in _stats(ev))
            module = _stat(ev, "hlo_module")
            if module is not None:  # one execution apart from the next by its run_id
                run = _stat(ev, "run_id")
                tag = str(module) if run is None else f"{module}#{run}"
                tagged.append((ev.start_ns, ev.duration_ns, tag))
        if not dev["modules"]:
            dev["modules"] = spans_from_kernels(tagged)
    for dev in out.values():
        dev["modules"].sort()
        dev["kernels"].sort()
    return out


def _stats(event) -> list:
    try:
        return list(event.stats)
    except (TypeError, ValueError):
        return []


def _stat(event, name: str):
    return dict(_stats(event)).get(name)


def spans_from_kernels(kernels: list[Event]) -> list[Event]:
    """Module spans from kernels tagged with their module (``name`` = the module's, with
    ``#run_id`` where the trace has it): each run of consecutive kernels with one tag is one span,
    from its first kernel's start to its last's end."""
    spans: list[list] = []
    for start, dur, module in sorted(kernels):
        end = start + dur
        if spans and spans[-1][2] == module:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end, module])
    return [(a, b - a, m) for a, b, m in spans]


def busy_intervals(events: list[Event]) -> list[tuple[int, int]]:
    """The union of the events' [start, end) intervals, in order (streams may overlap)."""
    merged: list[list[int]] = []
    for start, dur, _ in sorted(events):
        end = start + dur
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def segments(kernels: list[Event], t0: int, t1: int, *, join_ns: int = 20_000) -> list[list]:
    """Kernels starting in [t0, t1) as segments: kernels closer than ``join_ns`` join one. Each is
    [start ms from t0, span ms, busy ms, kernels, the two kernel names that took most time]: a
    launch-bound stretch shows as a long span with little busy time, a wait as a gap."""
    groups: list[list[Event]] = []
    end = None
    for k in sorted(k for k in kernels if t0 <= k[0] < t1):
        if groups and k[0] - end < join_ns:
            groups[-1].append(k)
            end = max(end, k[0] + k[1])
        else:
            groups.append([k])
            end = k[0] + k[1]
    rows = []
    for ks in groups:
        busy = busy_intervals(ks)
        per: dict[str, int] = collections.defaultdict(int)
        for _, dur, name in ks:
            per[name[:48]] += dur
        rows.append(
            [
                round((busy[0][0] - t0) / 1e6, 3),
                round((busy[-1][1] - busy[0][0]) / 1e6, 3),
                round(sum(b - a for a, b in busy) / 1e6, 3),
                len(ks),
                sorted(per, key=lambda n: -per[n])[:2],
            ]
        )
    return rows


def _module_at(modules: list[Event], t: int) -> str:
    """The module running at time ``t`` (or the last one to start before it)."""
    name = "-"
    for start, _dur, mod in modules:
        if start > t:
            break
        name = mod
    return short(name)


def short(name: str) -> str:
    """``jit_target_verify(1234)`` or ``jit_target_verify#5`` -> ``target_verify``."""
    name = name.split("(")[0].split("#")[0]
    return name[4:] if name.startswith("jit_") else name


def summarize(modules: list[Event], kernels: list[Event], *, top: int = 8) -> dict:
    """One device: span and busy milliseconds (kernels), the ``top`` largest idle gaps with the
    modules before and after each, and per-module launches and milliseconds of span."""
    busy = busy_intervals(kernels)
    if not busy:
        return {"kernels": 0}
    span = busy[-1][1] - busy[0][0]
    busy_ns = sum(b - a for a, b in busy)
    gaps = sorted(
        ((nxt[0] - cur[1], cur[1], nxt[0]) for cur, nxt in zip(busy, busy[1:], strict=False)),
        reverse=True,
    )
    per_module: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for _, dur, name in modules:
        per_module[short(name)][0] += 1
        per_module[short(name)][1] += dur / 1e6
    return {
        "kernels": len(kernels),
        "span_ms": round(span / 1e6, 3),
        "busy_ms": round(busy_ns / 1e6, 3),
        "idle_ms": round((span - busy_ns) / 1e6, 3),
        "largest_gaps": [
            {
                "ms": round(g / 1e6, 3),
                "after": _module_at(modules, a - 1),
                "before": _module_at(modules, b),
            }
            for g, a, b in gaps[:top]
        ],
        "modules": {k: {"count": v[0], "ms": round(v[1], 3)} for k, v in per_module.items()},
    }


def timeline(devices: dict[str, dict[str, list[Event]]], *, skip: int = 0, n: int = 40) -> list:
    """Module spans of all devices in start order, ``n`` of them after the first ``skip``:
    [device index, module, start ms (from the first listed), duration ms]."""
    spans = sorted(
        (start, dur, i, short(name))
        for i, dev in enumerate(devices.values())
        for start, dur, name in dev["modules"]
    )[skip : skip + n]
    if not spans:
        return []
    t0 = spans[0][0]
    return [[i, name, round((s - t0) / 1e6, 3), round(d / 1e6, 3)] for s, d, i, name in spans]
