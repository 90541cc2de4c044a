"""Benchmark and check the decode / tree attention kernels against XLA and jax's Pallas ``gqa``.

On a GPU (the numbers that matter, an H200):

    python benchmarks/bench_kernels.py --out benchmarks/results/kernels_h200.json

On CPU, a smoke run with tiny shapes through the Pallas interpreter (sanity check only):

    python benchmarks/bench_kernels.py --smoke --out /tmp/kernels_smoke.json

Shapes: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128, bf16). Decode (T=1, the
block is the new token) for B in (1, 64) and S in (1024, 8192, 32768), plus tree verification
(T=16 and T=64 with a random tree mask). For each case it reports the median time in
microseconds (a device-side loop, and back-to-back host calls) and the achieved KV bandwidth (K and
V bytes of the cache / device time) of:
``ours`` (pallas_kernels.decode_attention), ``xla`` (jitted pallas_kernels.reference.attend), and
``jax_gqa`` (jax.experimental.pallas.ops.gpu.decode_attention.gqa, T=1 only, defaults and
k_splits=16). Every implementation is first checked against the float32 reference.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import metadata  # noqa: E402
from pallas_kernels.decode_attention import decode_attention, plan  # noqa: E402
from pallas_kernels.reference import attend  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import decode_attention as jax_decode  # noqa: E402


def tree_mask(rng: np.random.Generator, t: int) -> np.ndarray:
    """A random tree over t nodes in topological order: node i sees itself and its ancestors."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
    mask = np.zeros((t, t), bool)
    for i in range(t):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


def make_case(b, s, t, h, kh, hd, dtype, seed=0):
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, t, h, hd), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s, kh, hd), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, kh, hd), jnp.float32).astype(dtype)
    length = jnp.full((b,), s - t, jnp.int32)  # prefix + block fill the cache
    mask = np.stack([tree_mask(rng, t) for _ in range(b)]) if t > 1 else np.ones((b, 1, 1), bool)
    return q, k, v, length, jnp.asarray(mask)


def time_host(fn, args, *, repeats: int, inner: int) -> float:
    """Median over ``repeats`` of the mean time of ``inner`` back-to-back jitted calls (us):
    includes the host's dispatch cost, which dominates small cases."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner * 1e6)
    return statistics.median(times)


def time_device(fn, args, *, repeats: int, iters: int) -> float:
    """Median over ``repeats`` of the per-iteration time (us) of a jitted ``fori_loop`` running
    ``fn`` ``iters`` times, each query perturbed by the previous output (so nothing is hoisted):
    device time plus in-graph launch cost, as inside a jitted decode step."""
    q, *rest = args

    @jax.jit
    def loop(q, *rest):
        def body(_, out):
            return fn(q + (out * 1e-3).astype(q.dtype), *rest)

        return jax.lax.fori_loop(0, iters, body, jnp.zeros_like(q))

    jax.block_until_ready(loop(q, *rest))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(q, *rest))
        times.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(times)


def parse():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--inner", type=int, default=None, help="calls per host-loop timing")
    ap.add_argument("--iters", type=int, default=None, help="iterations per device-loop timing")
    ap.add_argument("--batches", type=int, nargs="*", default=None)
    ap.add_argument("--seqs", type=int, nargs="*", default=None)
    ap.add_argument("--trees", type=int, nargs="*", default=None, help="T values of tree cases")
    ap.add_argument("--tune", action="store_true", help="also time block_k/num_warps variants")
    args = ap.parse_args()
    smoke = args.smoke  # the CPU interpreter on tiny heads; else Llama-3-8B's
    args.heads = (4, 2, 64) if smoke else (32, 8, 128)
    args.batches = args.batches or ([1, 2] if smoke else [1, 64])
    args.seqs = args.seqs or ([256] if smoke else [1024, 8192, 32768])
    args.trees = args.trees if args.trees is not None else ([8] if smoke else [16, 64])
    args.repeats = args.repeats or (2 if smoke else 10)
    args.inner = args.inner or (1 if smoke else 20)
    args.iters = args.iters or (2 if smoke else 50)
    return args


def implementations(args, s: int, t: int) -> dict:
    """{name: jitted fn(q, k, v, length, mask)} of one case: ours (and its tuning variants with
    ``--tune``), XLA's reference, jax's GQA kernel at decode."""
    interpret = args.smoke

    def ours(**kw):
        return jax.jit(
            lambda q, k, v, n, m: decode_attention(q, k, v, n, m, interpret=interpret, **kw)
        )

    def jax_gqa(k_splits):
        def f(q, k, v, n, m):
            return jax_decode.gqa(
                q[:, 0], k, v, kv_seq_len=n + 1, k_splits=k_splits, interpret=interpret
            )[:, None].astype(q.dtype)

        return jax.jit(f)

    impls = {"ours": ours(), "xla": jax.jit(attend)}
    if t == 1:
        impls["jax_gqa_ks16"] = jax_gqa(16)
        if s // 64 >= 16:
            impls["jax_gqa_ks64"] = jax_gqa(64)
    if args.tune and not args.smoke:
        for bk in (32, 64, 128):
            for nw in (4, 8):
                for ns in (2, 3):
                    impls[f"ours_bk{bk}_w{nw}_s{ns}"] = ours(
                        block_k=bk, num_warps=nw, num_stages=ns
                    )
        for ks in (4, 16, 32, 64, 128):
            if s // ks >= 64:
                impls[f"ours_ks{ks}"] = ours(k_splits=ks)
        if t > 1:
            for bm in (16, 32, 128):
                impls[f"ours_bm{bm}_w8"] = ours(block_m=bm, num_warps=8)
    return impls


def case_rows(args, b: int, s: int, t: int) -> list[dict]:
    """Every implementation on one case: its error against the float32 reference and its
    device-loop and host-loop times (or the error it raised)."""
    h, kh, hd = args.heads
    dtype = jnp.bfloat16
    q, k, v, length, mask = make_case(b, s, t, h, kh, hd, dtype)
    kv_bytes = 2 * b * s * kh * hd * jnp.dtype(dtype).itemsize
    want = attend(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), length, mask)
    p = plan(b, s, kh, t * (h // kh), head_dim=hd)
    rows = []
    for name, fn in implementations(args, s, t).items():
        row = dict(impl=name, B=b, S=s, T=t, H=h, KH=kh, hd=hd, dtype=str(jnp.dtype(dtype)))
        try:
            got = fn(q, k, v, length, mask)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
            xs = (q, k, v, length, mask)
            us = time_device(fn, xs, repeats=args.repeats, iters=args.iters)
            us_host = time_host(fn, xs, repeats=args.repeats, inner=args.inner)
            row.update(us=us, tb_s=kv_bytes / us / 1e6, us_host=us_host, max_abs_err=err)
            if name == "ours":
                row.update({k: p[k] for k in ("k_splits", "block_k", "block_m", "num_stages")})
        except Exception as e:  # noqa: BLE001 - record and continue
            row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    args = parse()
    cases = [(b, s, 1) for b in args.batches for s in args.seqs]
    cases += [(b, s, t) for t in args.trees for b in args.batches for s in args.seqs[:2]]
    rows = [row for b, s, t in cases for row in case_rows(args, b, s, t)]
    meta = dict(
        metadata(),
        backend=jax.default_backend(),
        devices=[str(d.device_kind) for d in jax.devices()],
        python=platform.python_version(),
        smoke=args.smoke,
        timing=f"us: median of {args.repeats} device loops of {args.iters} calls; "
        f"us_host: median of {args.repeats} x mean of {args.inner} back-to-back host calls",
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, results=rows), indent=1))

    print(f"\n{meta['devices'][0]}  jax {meta['jax']}  ({meta['timing']})")
    print(
        f"{'impl':<24}{'B':>4}{'S':>7}{'T':>4}{'us':>10}{'TB/s':>8}{'us_host':>10}{'max err':>10}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:<24}{r['B']:>4}{r['S']:>7}{r['T']:>4}  ERROR {r['error'][:60]}")
        else:
            print(
                f"{r['impl']:<24}{r['B']:>4}{r['S']:>7}{r['T']:>4}"
                f"{r['us']:>10.1f}{r['tb_s']:>8.2f}{r['us_host']:>10.1f}{r['max_abs_err']:>10.2e}"
            )


if __name__ == "__main__":
    main()
