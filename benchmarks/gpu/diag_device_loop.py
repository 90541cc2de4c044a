"""Why does the on-device SwiftSpec loop (``loop="device"``) take longer than the threaded one?

Issue 4, session 7: on two H200s (422a005) the on-device loop took 10.38 ms an iteration against
8.02 threaded and 8.16 serial, about t_verify + d * t_draft, as if the verify and the d
expansions ran one after the other. This script answers three questions in one call:

1. ``cond``: does ``lax.cond`` on the mesh index inside ``shard_map`` stay a conditional in the
   GPU executable, and do the two devices run their branches at the same time? (Two heavy
   branches of different lengths, timed alone and split over the devices.)
2. ``trace``: the device loop's kernels per GPU under the profiler: busy and idle time, the
   kernels that take the time (verify kernels on the draft's GPU would mean both branches run),
   and the HLO's conditionals, while loops and collectives.
3. ``flags``: the device loop's iteration under XLA flag variants (each in a fresh process):
   command buffers that take conditionals and while loops on device.

    python benchmarks/gpu/diag_device_loop.py --out DIR [--part cond,trace,flags]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def cond_test() -> dict:
    d0, d1 = jax.devices()[:2]
    mesh = Mesh([d0, d1], ("w",))

    def chain(x, w, n):
        for _ in range(n):
            x = jnp.tanh(x @ w)
        return x

    def build(mode):
        def per(x, w):
            me = jax.lax.axis_index("w")
            if mode == "split":
                y = jax.lax.cond(me == 0, lambda v: chain(v, w, 40), lambda v: chain(v, w, 20), x)
            elif mode == "long":
                y = chain(x, w, 40)
            else:
                y = chain(x, w, 20)
            return y[None]

        return jax.jit(
            jax.shard_map(per, mesh=mesh, in_specs=P(), out_specs=P("w"), check_vma=False)
        )

    x = jax.device_put(jnp.ones((4096, 4096), jnp.bfloat16), NamedSharding(mesh, P()))
    w = jax.device_put(jnp.ones((4096, 4096), jnp.bfloat16) * 1e-3, NamedSharding(mesh, P()))
    out = {}
    for mode in ("long", "short", "split"):
        f = build(mode)
        jax.block_until_ready(f(x, w))
        t = []
        for _ in range(10):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, w))
            t.append(time.perf_counter() - t0)
        out[f"{mode}_ms"] = round(float(np.median(t)) * 1e3, 3)
        if mode == "split":
            text = f.lower(x, w).compile().as_text()
            out["hlo_conditionals"] = text.count(" conditional(")
    return out


def build_models():
    from benchmarks.shapes import LLAMA3_8B, LLAMA32_1B, SMOKE, SMOKE_DRAFT
    from jaxspec.model.transformer import new_model

    smoke = os.environ.get("DIAG_SMOKE") == "1"
    tcfg, dcfg = (SMOKE, SMOKE_DRAFT) if smoke else (LLAMA3_8B, LLAMA32_1B)
    dtype = jnp.float32 if smoke else jnp.bfloat16
    d0, d1 = jax.devices()[:2]
    with jax.default_device(d0):
        target = new_model(tcfg, seed=0, dtype=dtype)
    with jax.default_device(d1):
        draft = new_model(dcfg, seed=1, dtype=dtype)
    prompt = np.random.RandomState(0).randint(0, tcfg.vocab_size, 512).tolist()
    return target, draft, prompt


def run_loop(target, draft, prompt, loop="device", d=2):
    from jaxspec.api import generate

    return generate(
        target, [prompt], draft=draft, method="swiftspec", target_devices=1, draft_devices=1,
        loop=loop, max_new_tokens=48, depth=d, width=8, branch=4, bs=8,
    )  # fmt: skip


def trace_part(out_dir: str) -> dict:
    target, draft, prompt = build_models()
    loops = ("device", "threads")
    return {loop: trace_loop(out_dir, target, draft, prompt, loop) for loop in loops}


def trace_loop(out_dir: str, target, draft, prompt, loop: str) -> dict:
    from benchmarks import trace_gaps
    from jaxspec.engines import base as common

    run_loop(target, draft, prompt, loop=loop)
    r = run_loop(target, draft, prompt, loop=loop)
    steps = r.stats["verify_steps"]
    res = {"iteration_ms": round(r.stats["wall_s"] / steps * 1e3, 3), "verifications": steps}
    texts = [exe.as_text() for exe in common._COMPILED.values() if hasattr(exe, "as_text")]
    loop_text = max(texts, key=lambda t: t.count("while("))
    if loop == "device":
        with open(os.path.join(out_dir, "device_loop_hlo.txt"), "w") as f:
            f.write(loop_text)
    res["hlo"] = {
        k: loop_text.count(k)
        for k in (" conditional(", " while(", "collective-permute", "custom-call(", " fusion(")
    }
    tdir = os.path.join(out_dir, f"trace_{loop}")
    with jax.profiler.trace(tdir):
        r = run_loop(target, draft, prompt, loop=loop)
    res["traced_iteration_ms"] = round(r.stats["wall_s"] / r.stats["verify_steps"] * 1e3, 3)
    devs = trace_gaps.device_events(tdir)
    res["devices"] = {}
    starts = [k[0] for dev in devs.values() for k in dev["kernels"]]
    if not starts:
        return res
    # one clock for both GPUs: a 30 ms window (two to three iterations) in the middle of the run
    t0 = (min(starts) + max(starts)) // 2
    for name, dev in devs.items():
        ks = dev["kernels"]
        per = collections.defaultdict(lambda: [0, 0.0])
        for _, dur, kname in ks:
            per[kname[:60]][0] += 1
            per[kname[:60]][1] += dur / 1e6
        top = sorted(per.items(), key=lambda kv: -kv[1][1])[:25]
        busy = trace_gaps.busy_intervals(ks)
        res["devices"][name] = {
            "kernels": len(ks),
            "span_ms": round((busy[-1][1] - busy[0][0]) / 1e6, 3),
            "busy_ms": round(sum(b - a for a, b in busy) / 1e6, 3),
            "top_kernels": [[k, v[0], round(v[1], 3)] for k, v in top],
            "segments": trace_gaps.segments(ks, t0, t0 + 30_000_000),
        }
    return res


FLAG_VARIANTS = {
    "default": "",
    "cmdbuf_while_cond": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
    "cmdbuf_off": "--xla_gpu_enable_command_buffer=",
}


def one_variant() -> None:
    target, draft, prompt = build_models()
    out = {}
    for loop in ("device", "threads"):
        run_loop(target, draft, prompt, loop=loop)
        r = run_loop(target, draft, prompt, loop=loop)
        out[loop] = round(r.stats["wall_s"] / r.stats["verify_steps"] * 1e3, 3)
    print("RESULT " + json.dumps(out), flush=True)


def flags_part() -> dict:
    res = {}
    for name, flags in FLAG_VARIANTS.items():
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
        t0 = time.perf_counter()
        p = subprocess.run(
            [sys.executable, __file__, "--one"], env=env, capture_output=True, text=True,
            timeout=200,
        )  # fmt: skip
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        res[name] = json.loads(line[-1][7:]) if line else {"error": p.stderr[-800:]}
        res[name]["s"] = round(time.perf_counter() - t0, 1)
        print(name, res[name], flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--part", default="cond,trace,flags")
    ap.add_argument("--one", action="store_true")
    args = ap.parse_args()
    if args.one:
        return one_variant()
    res = {"jax": jax.__version__, "commit": os.environ.get("JAXSPEC_COMMIT", "unknown")}
    for part in args.part.split(","):
        t0 = time.perf_counter()
        parts = {"cond": cond_test, "flags": flags_part, "trace": lambda: trace_part(args.out)}
        res[part] = parts[part]()
        print(part, json.dumps(res[part])[:3000], f"({time.perf_counter() - t0:.0f} s)", flush=True)
        with open(os.path.join(args.out, "diag_device_loop.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
