"""Where a SmolLM2-shape decode step's time goes on the GPU (issues 10 and 5): steps/s of a
device loop and, from a profiler trace of the same loop, GPU kernel count, busy time and the
kernels that take it, per step.

    python benchmarks/probe_small.py --label NAME [--context 1024] [--batch 1] [--tokens 1] \
        [--out DIR] [--file small_step_probe.json]
Run it under different XLA_FLAGS to compare compiler options (one process per setting). With
``--batch 128 --context 512`` it is the shape of a MagicDec self-draft step (a 512-token sparse
cache) at batch 128; with ``--tokens 5`` (or 16) each step is a causal block of that many tokens
a row, the kernels of a chain's (or a 16-node tree's) verify.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_decode_gpu import kernel_count, make_loop  # noqa: E402
from benchmarks.common import metadata  # noqa: E402
from benchmarks.shapes import SMOLLM2_135M  # noqa: E402
from benchmarks.trace_gaps import gpu_planes, stream_events  # noqa: E402
from jaxspec.kernels import KernelConfig  # noqa: E402
from jaxspec.model.kv_cache import KVCache, init_cache  # noqa: E402
from jaxspec.model.transformer import new_model  # noqa: E402


def gpu_events(trace_dir: str):
    return sorted(
        (ev.start_ns, ev.duration_ns, ev.name)
        for plane in gpu_planes(trace_dir)
        for ev in stream_events(plane)
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="default")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1, help="tokens a row per step (a verify block)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--file", default="small_step_probe.json", help="JSON file in --out")
    args = ap.parse_args()
    cfg = SMOLLM2_135M
    model = new_model(cfg, seed=0, dtype=jnp.bfloat16)
    b = args.batch
    t = args.tokens
    cache = init_cache(cfg, b, args.context + args.steps * t + 8, jnp.bfloat16)
    cache = KVCache(k=cache.k, v=cache.v, length=jnp.full((b,), args.context, jnp.int32))
    tok = jnp.zeros((b, t), jnp.int32)
    net = model.net(KernelConfig.from_env())
    loop = make_loop(net, args.steps, t)
    exe = loop.lower(model.flat, cache, tok).compile()
    counts = kernel_count(exe.as_text())
    state = {"cache": cache}

    def once():
        c, out = exe(model.flat, state["cache"], tok)
        state["cache"] = KVCache(k=c.k, v=c.v, length=c.length - args.steps * t)
        out.block_until_ready()

    for _ in range(3):
        once()
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    ms = sorted(times)[3] / args.steps * 1e3
    row = {
        "label": args.label,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "kernels": net.kernels.describe(),
        "batch": b,
        "tokens": t,
        "context": args.context,
        "ms_per_step": ms,
    }
    row.update({k: v for k, v in counts.items() if k in ("fusion_ops", "custom_calls")})
    tdir = f"/tmp/trace_{args.label}"
    try:
        with jax.profiler.trace(tdir):
            once()
        ev = gpu_events(tdir)
        if ev:
            span = (ev[-1][0] + ev[-1][1] - ev[0][0]) / 1e6
            busy = sum(d for _, d, _ in ev) / 1e6
            by = collections.Counter()
            n = collections.Counter()
            for _, d, name in ev:
                key = name.split(".")[0][:40]
                by[key] += d
                n[key] += 1
            row.update(
                kernels_per_step=len(ev) / args.steps,
                gpu_span_ms_per_step=span / args.steps,
                gpu_busy_ms_per_step=busy / args.steps,
                mean_kernel_us=busy * 1e3 / len(ev),
                top=[
                    (k, n[k] // args.steps, round(v / 1e3 / args.steps, 1))
                    for k, v in by.most_common(14)
                ],
            )
            # about two layers' kernels in issue order, from the middle of the trace
            per_layer = max(1, len(ev) // args.steps // cfg.num_layers)
            mid = len(ev) // 2
            row["sequence"] = [
                (name.split(".")[0][:48], round(d / 1e3, 2))
                for _, d, name in ev[mid : mid + 2 * per_layer + 2]
            ]
    except Exception as e:  # the probe still reports the timing
        row["trace_error"] = repr(e)[:300]
    print(json.dumps(row, indent=1), flush=True)
    path = pathlib.Path(args.out) / args.file  # one file, a row per setting
    payload = json.loads(path.read_text()) if path.is_file() else {**metadata(), "rows": []}
    payload["rows"].append(row)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    if os.environ.get("DUMP_HLO"):
        with open(f"{args.out}/hlo_{args.label}.txt", "w") as f:
            f.write(exe.as_text())


if __name__ == "__main__":
    main()
