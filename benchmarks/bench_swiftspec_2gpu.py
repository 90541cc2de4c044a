"""SwiftSpec iteration time on two devices against the serial tree engine, same tree sizes.

Target: Llama-3-8B shape on device 0; draft: Llama-3.2-1B shape on device 1 (random bf16 weights
made on the devices; acceptance from random weights means nothing, so this measures iteration
time, which is what the overlap changes). Measures t_verify(bs), t_draft (one expansion of w
leaves), the handoffs, picks d = round((t_verify - handoff) / t_draft) as ``jaxspec profile``
would, then runs both engines for the same number of new tokens.

    python benchmarks/bench_swiftspec_2gpu.py [--new 48] [--smoke] [--trace DIR]

``--loops-only D``: no profile, no variants: d = D, and the threaded loop, the on-device loop
(``loop="device"``, swiftspec_device) and the serial tree engine, each run twice (the first
compiles), into ``swiftspec_2gpu_loops.json``. A short call for a GPU session's last minutes.

``--trace DIR`` runs the async engine once more under ``jax.profiler.trace`` and adds ``trace``
to the JSON (``benchmarks/trace_gaps.py``): per GPU, busy and idle milliseconds, the largest idle
gaps with the XLA modules around them, and a timeline of module spans of both GPUs in the middle
of the run. It shows which of verify, grow, re-root/snapshot and the handoffs sets the iteration.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.common import metadata, random_target, write  # noqa: E402
from benchmarks.shapes import LLAMA3_8B, LLAMA32_1B, SMOKE, SMOKE_DRAFT  # noqa: E402
from jaxspec.api import generate  # noqa: E402
from jaxspec.measure import split as profiler  # noqa: E402
from jaxspec.model.transformer import with_params  # noqa: E402


def device_put_blocks(d0, d1) -> dict:
    """Host milliseconds of a cross-device ``jax.device_put`` of a value still being computed
    (a ~20 ms matmul chain on d1) against one of a ready value: whether the handoff blocks the
    host until its source is ready (then the host sits on the critical path)."""
    import time

    x = jax.device_put(jnp.ones((4096, 4096), jnp.bfloat16), d1)
    work = jax.jit(lambda a: jax.lax.fori_loop(0, 60, lambda _, b: (b @ a) * 1e-3, a)[:4, :4])
    jax.block_until_ready(work(x))
    out = {}
    for name in ("pending", "ready"):
        y = work(x)
        if name == "ready":
            jax.block_until_ready(y)
        t = time.perf_counter()
        z = jax.device_put(y, d0)
        out[name] = round((time.perf_counter() - t) * 1e3, 3)
        jax.block_until_ready(z)
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length if one is a
    prefix of the other), or None when they are equal."""
    if a == b:
        return None
    parts = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(parts, min(len(a), len(b)))


def traced(trace_dir: str, common: dict, draft) -> dict:
    """One more async run under the profiler: per-GPU busy/idle, largest gaps, a timeline."""
    from benchmarks import trace_gaps

    with jax.profiler.trace(trace_dir):
        r = generate(**common, draft=draft, method="swiftspec", target_devices=1, draft_devices=1)
    devices = trace_gaps.device_events(trace_dir)
    steps = r.stats["verify_steps"]
    return {
        "iteration_ms": iteration_ms(r),
        "verify_steps": steps,
        "devices": {
            name: trace_gaps.summarize(dev["modules"], dev["kernels"])
            for name, dev in devices.items()
        },
        # module spans from the middle of the run: ~4 modules per iteration over both GPUs
        "timeline": trace_gaps.timeline(devices, skip=2 * steps, n=40),
        "kernel_stat_names": trace_gaps.STAT_NAMES,
    }


def iteration_ms(r) -> float:
    """Milliseconds per verification of a run (SwiftSpec's verify steps; the serial engine's
    loop iterations after its prefill)."""
    return round(r.stats["wall_s"] / verifications(r) * 1e3, 3)


def verifications(r) -> int:
    st = r.stats
    return st["verify_steps"] if st.method == "swiftspec" else st["target_steps"] - 1


def twice(**kw):
    """``generate(**kw)`` twice: the first compiles (excluded from wall_s anyway) and warms up."""
    generate(**kw)
    return generate(**kw)


def models(args):
    """The target on device 0, the draft on device 1 (random weights, the environment's
    kernels), the draft's copy on device 0 for the serial tree engine, and the prompt."""
    tcfg, dcfg = (SMOKE, SMOKE_DRAFT) if args.smoke else (LLAMA3_8B, LLAMA32_1B)
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    d0, d1 = jax.devices()[:2]
    with jax.default_device(d0):
        target = random_target(tcfg, seed=0, dtype=dtype)
    with jax.default_device(d1):
        draft = random_target(dcfg, seed=1, dtype=dtype)
    serial_draft = with_params(draft, jax.device_put(draft.params, d0))
    prompt = np.random.RandomState(0).randint(0, tcfg.vocab_size, args.prompt).tolist()
    return target, draft, serial_draft, prompt


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--trace", default=None, metavar="DIR", help="profile one more async run")
    ap.add_argument("--loops-only", type=int, default=None, metavar="D")
    args = ap.parse_args()
    target, draft, serial_draft, prompt = models(args)
    shape = dict(width=8, branch=4, bs=8)
    if args.loops_only:
        return loops_only(args, target, draft, serial_draft, prompt, shape)
    prof = profiler.measure(target, draft, prompt, (1, 1), **shape, reps=args.reps)
    prof16 = profiler.measure(target, draft, prompt, (1, 1), **{**shape, "bs": 16}, reps=args.reps)
    print(prof, prof16, flush=True)
    d = prof.d
    common = dict(target=target, prompts=[prompt], max_new_tokens=args.new, depth=d, **shape)
    # the async engine with its loop on the devices (loop="device": one program over both GPUs,
    # handoffs by ppermute), then the threaded loop (host handoffs) and its variants that put
    # draft work back on the critical path
    variants = {"device": {"loop": "device"}, "threads": {"loop": "threads"}}
    variants[f"refill_{d}"] = {"refill": d, "loop": "threads"}
    if d > 1:  # fewer expansions per verify: are the grows on the critical path?
        variants[f"depth_{d - 1}"] = {"depth": d - 1, "loop": "device"}
    one = dict(draft=draft, method="swiftspec", target_devices=1, draft_devices=1)
    runs = {}
    for name, opts in variants.items():
        runs[name] = twice(**{**common, **one, **opts})
        print(name, iteration_ms(runs[name]), "ms", flush=True)
    rs = twice(**common, draft=serial_draft, method="tree")
    payload = report(args, target, prof, prof16, variants, runs, rs)
    if args.trace:
        payload["trace"] = traced(args.trace, common, draft)
    write("swiftspec_2gpu_smoke.json" if args.smoke else "swiftspec_2gpu.json", payload, args.out)
    for k in (
        "t_verify_ms", "t_verify_bs16_ms", "t_draft_ms", "handoff_ms", "d", "iteration_ms_async",
        "iteration_ms_async_threads", "iteration_ms_serial", "async_over_serial", "bound_ms",
        "async_over_bound", "identical_tokens",
    ):  # fmt: skip
        print(f"{k:>22} {payload[k]}")


def report(args, target, prof, prof16, variants, runs, rs) -> dict:
    """The JSON: the profile, each loop's iteration against the serial engine and the bound."""
    r = runs["device"]
    async_ms, serial_ms = iteration_ms(r), iteration_ms(rs)
    bound = max(prof.t_verify_ms, prof.d * prof.t_draft_ms + prof.handoff_ms)
    d0, d1 = jax.devices()[:2]
    return {
        **metadata(),
        **shapes(args),
        "dtype": str(jnp.dtype(target.dtype)),
        "kernels": target.net().kernels.describe(),
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "d": prof.d,
        "bs": 8,
        "width": 8,
        "branch": 4,
        "t_verify_ms": round(prof.t_verify_ms, 3),
        "t_verify_bs16_ms": round(prof16.t_verify_ms, 3),
        "t_draft_ms": round(prof.t_draft_ms, 3),
        "handoff_ms": round(prof.handoff_ms, 3),
        "loop": "device",
        "iteration_ms_async": async_ms,
        "iteration_ms_async_threads": iteration_ms(runs["threads"]),
        "iteration_ms_serial": serial_ms,
        "async_over_serial": round(async_ms / serial_ms, 3),
        "bound_ms": round(bound, 3),
        "async_over_bound": round(async_ms / bound, 3),
        "expansions_in_flight": r.stats["expansions_in_flight"],
        "verify_steps_async": r.stats["verify_steps"],
        "target_steps_serial": rs.stats["target_steps"],
        "device_put_blocks_ms": device_put_blocks(d0, d1),
        "identical_tokens": all(x.tokens == rs.tokens for x in runs.values()),
        "variants": {
            name: {
                "options": variants[name],
                "iteration_ms": iteration_ms(x),
                "acceptance_length": round(x.stats["acceptance_length"], 3),
                "expansions_in_flight": x.stats["expansions_in_flight"],
                "refill_expansions": x.stats["refill_expansions"],
                "verify_steps": x.stats["verify_steps"],
                "host_ms_per_iteration": x.stats["host_ms_per_iteration"],
                # bf16 tokens against the serial engine's; where they part, at which token
                "tokens_equal_serial": x.tokens == rs.tokens,
                "first_difference": first_difference(x.tokens[0], rs.tokens[0]),
            }
            for name, x in runs.items()
        },
    }


def shapes(args) -> dict:
    return {
        "target_shape": "smoke" if args.smoke else "Llama-3-8B",
        "draft_shape": "smoke" if args.smoke else "Llama-3.2-1B",
        "weights": "random",
    }


def loops_only(args, target, draft, serial_draft, prompt, shape: dict) -> None:
    """Threaded against on-device loop against the serial tree engine at d = --loops-only."""
    common = dict(target=target, prompts=[prompt], max_new_tokens=args.new, **shape)
    common["depth"] = args.loops_only
    one = dict(draft=draft, method="swiftspec", target_devices=1, draft_devices=1)
    runs = {
        "threads": dict(**common, **one, loop="threads"),
        "device": dict(**common, **one, loop="device"),
        "serial": dict(**common, draft=serial_draft, method="tree"),
    }
    out = {}
    for name, kw in runs.items():
        r = twice(**kw)
        out[name] = {
            "iteration_ms": iteration_ms(r),
            "verifications": verifications(r),
            "compile_s": round(r.stats.get("compile_s", 0.0), 1),
            "tokens": r.tokens[0],
        }
        print(name, out[name]["iteration_ms"], "ms", flush=True)
    payload = {
        **metadata(),
        **shapes(args),
        "kernels": target.net().kernels.describe(),
        "d": args.loops_only,
        **shape,
        "iteration_ms": {k: v["iteration_ms"] for k, v in out.items()},
        "verifications": {k: v["verifications"] for k, v in out.items()},
        "device_over_serial": round(
            out["device"]["iteration_ms"] / out["serial"]["iteration_ms"], 3
        ),
        "threads_over_serial": round(
            out["threads"]["iteration_ms"] / out["serial"]["iteration_ms"], 3
        ),
        "identical_tokens": out["device"]["tokens"] == out["threads"]["tokens"],
    }
    write("swiftspec_2gpu_loops.json", payload, args.out)


if __name__ == "__main__":
    main()
