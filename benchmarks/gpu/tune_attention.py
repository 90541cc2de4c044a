"""Tiling of the decode-attention kernel for SmolLM2's heads (9 query heads, 3 KV heads, head_dim
64), where a step is launch- and latency-bound rather than bandwidth-bound (issues 10 and 5).

For each (batch, context) it times ``pallas_kernels.decode_attention`` (the kernel and its
split-K merge, as a model layer runs them) back to back in an on-device loop: first the
shortest split (``min_split``, which sets ``k_splits``) x ``block_k`` at the default warps and
stages, then warps x stages at the best of those. One JSON line per case.

    python benchmarks/gpu/tune_attention.py [--cases 1:1024,128:512] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import jax
import jax.numpy as jnp

from jaxspec.timing import loop_ms, repeat
from pallas_kernels.decode_attention import decode_attention, plan

H, KH, HD = 9, 3, 64


def time_config(b, s, cfg, reps=5):
    cap = s + 16
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, 1, H, HD), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, cap, KH, HD), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, cap, KH, HD), jnp.bfloat16)
    length = jnp.full((b,), s, jnp.int32)
    bm = jnp.ones((b, 1, 1), bool)

    def step(q, k, v, length, bm):
        out = decode_attention(q, k, v, length, bm, **cfg)
        return q + out * jnp.bfloat16(1e-3)

    run = jax.jit(repeat(step), donate_argnums=(0,))
    return loop_ms(run, q, k, v, length, bm, n=32, reps=reps) * 1e3  # us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1:1024,1:4096,128:512,128:2048,32:7168")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        b, s = map(int, case.split(":"))
        cap = s + 16
        default = plan(b, cap, KH, 3, head_dim=HD)
        results = {"default": time_config(b, s, {})}
        for min_split, block_k in itertools.product((32, 64, 128, 256, 512), (32, 64, 128)):
            if block_k > min_split:
                continue
            ksp = plan(b, cap, KH, 3, block_k=block_k, min_split=min_split, head_dim=HD)["k_splits"]
            cfg = dict(k_splits=ksp, block_k=block_k)
            results[json.dumps(cfg)] = time_config(b, s, cfg)
        best = min((k for k in results if k != "default"), key=results.get)
        base = json.loads(best)
        for warps, stages in itertools.product((2, 4, 8), (1, 2, 3)):
            cfg = dict(base, num_warps=warps, num_stages=stages)
            try:
                results[json.dumps(cfg)] = time_config(b, s, cfg)
            except Exception as e:  # noqa: BLE001 - a tiling Triton rejects
                results[json.dumps(cfg)] = f"error {type(e).__name__}"
        timed = {k: v for k, v in results.items() if isinstance(v, float)}
        best = min(timed, key=timed.get)
        kv_bytes = 2 * b * s * KH * HD * 2
        row = dict(
            batch=b,
            context=s,
            default_plan={k: default[k] for k in ("k_splits", "block_k", "num_warps")},
            default_us=results["default"],
            best=best,
            best_us=timed[best],
            best_tb_s=kv_bytes / timed[best] / 1e6,
            all={k: (round(v, 2) if isinstance(v, float) else v) for k, v in results.items()},
        )
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "all"}), flush=True)
    with open(f"{args.out}/tune_attention.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
