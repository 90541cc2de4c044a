"""All-reduce of decode-sized messages over N GPUs: XLA's all-reduce (NCCL) against the one-shot
algorithm (the Mosaic GPU kernel of ``pallas_kernels/all_reduce.py`` and its ``jax.lax`` form).

Each figure is the time of one all-reduce inside a jitted ``lax.fori_loop`` of ``--chain``
dependent reductions (each reduction's input is the last one's output, scaled by 1/N so values
stay put), divided by the chain length: the per-collective cost a decode step pays, launch
included, without a host round trip per reduction. Before timing, each method's result is checked
against psum (the kernel must equal the reference bit for bit). Issue 26's goal: at most 8 us a
reduction for a decode-sized message.

    python benchmarks/bench_all_reduce.py --devices 2 --out all_reduce.json   # on 2+ GPUs
    python benchmarks/bench_all_reduce.py --smoke    # CPU: forced host devices, no kernel
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.common import metadata  # noqa: E402
from jaxspec.timing import median_ms  # noqa: E402
from pallas_kernels import all_reduce as AR  # noqa: E402

AXIS = "tp"
# [rows, hidden]: a batch-1 decode step of Llama-3-8B (1 row, or 8 padded rows) and of 70B
SIZES = {"8b_row": (1, 4096), "8b_rows8": (8, 4096), "70b_row": (1, 8192), "70b_rows8": (8, 8192)}
METHODS = {
    "psum": lambda x, n: jax.lax.psum(x, AXIS),
    "oneshot_reference": lambda x, n: AR.reference(x, AXIS),
    "oneshot": lambda x, n: AR.oneshot(x, axis_name=AXIS, num_devices=n),
}


def program(method: str, n: int, chain: int, mesh):
    """``chain`` dependent reductions of each device's block ``[rows, d]`` by ``method``."""
    reduce = METHODS[method]

    def body(x):
        def one(_, y):
            return (reduce(y, n).astype(jnp.float32) / n).astype(y.dtype)

        return jax.lax.fori_loop(0, chain, one, x)

    spec = PartitionSpec(AXIS)
    once = jax.shard_map(
        lambda x: reduce(x, n), mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
    )
    looped = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    return jax.jit(once), jax.jit(looped)


def run(n: int, methods: list[str], sizes: list[str], chain: int, reps: int, dtype) -> list[dict]:
    devices = jax.devices()[:n]
    mesh = jax.make_mesh((n,), (AXIS,), devices=devices, axis_types=(AxisType.Auto,))
    rows = []
    for size in sizes:
        r, d = SIZES[size]
        x = jax.random.normal(jax.random.key(0), (n * r, d), jnp.float32).astype(dtype)
        x = jax.device_put(x, NamedSharding(mesh, PartitionSpec(AXIS)))
        want = np.asarray(program("psum", n, 1, mesh)[0](x), np.float32)
        ref = np.asarray(program("oneshot_reference", n, 1, mesh)[0](x))
        for method in methods:
            row = dict(devices=n, size=size, shape=[r, d], dtype=jnp.dtype(dtype).name,
                       message_bytes=r * d * jnp.dtype(dtype).itemsize, method=method)  # fmt: skip
            try:
                once, looped = program(method, n, chain, mesh)
                got = np.asarray(once(x))
                row["max_abs_vs_psum"] = float(np.max(np.abs(got.astype(np.float32) - want)))
                row["equals_reference"] = bool(np.array_equal(got, ref))
                row["us_per_all_reduce"] = _us(looped, x, reps, chain)
            except Exception as e:  # a method that does not run here is recorded, others go on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _us(looped, x, reps: int, chain: int) -> float:
    """Microseconds a reduction of the chain ``looped`` takes, median of ``reps`` runs."""
    return round(median_ms(lambda: looped(x), reps) * 1e3 / chain, 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--devices", default="2", help="comma-separated device counts, e.g. 2,4")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--chain", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="CPU: psum and the reference, float32")
    ap.add_argument("--out", default="benchmarks/results/all_reduce.json")
    args = ap.parse_args()
    methods = args.methods.split(",")
    dtype = jnp.bfloat16
    if args.smoke:
        methods = [m for m in methods if m != "oneshot"]
        dtype, args.chain, args.reps = jnp.float32, 8, 2
    rows = []
    for n in (int(v) for v in args.devices.split(",")):
        if n > jax.device_count():
            print(f"skipping {n} devices: this machine has {jax.device_count()}", flush=True)
            continue
        rows += run(n, methods, args.sizes.split(","), args.chain, args.reps, dtype)
    payload = {**metadata(), "chain": args.chain, "rows": rows}
    payload["nccl_nvls_enable"] = os.environ.get("NCCL_NVLS_ENABLE", "")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"{'n':>2} {'size':>10} {'method':>18} {'us':>8}")
    for r in rows:
        us = r.get("us_per_all_reduce", "error")
        print(f"{r['devices']:>2} {r['size']:>10} {r['method']:>18} {us:>8}")


if __name__ == "__main__":
    main()
