"""MagicDec's cost model for a Llama-3.1-8B-shape model (random bf16 weights made on the device):
measured T_T(B, S), T_D(B) (the target itself over a StreamingLLM cache of ``--budget`` tokens:
self-speculation) and T_V(B, S, gamma), their ratios to T_T, and the speedup the cost model
predicts at ``--alpha`` (0.8: MagicDec's measured acceptance at a 512 budget).

    python benchmarks/bench_magicdec_8b.py [--batches 1,8,32,64,128]
        [--prefixes 1024,4096,8192,16384,32768] [--kv-gib 100] [--budget-s 200]
        [--out benchmarks/results/magicdec_8b.json]

Every time is one forward of the model (``jaxspec.model.transformer.apply``, the engines' own
forward, with the ragged decode-attention kernel on a GPU), timed back to back in an on-device loop
with its KV cache donated and handed on, as inside the engines' loops (``timing.loop_ms_consuming``:
no host call's overhead is counted); every executable is compiled before anything is timed. T_T
over 1 token, T_V(gamma) over gamma + 1 tokens (measured at gamma 1, 3 and 7; other gammas
interpolated linearly in the number of tokens between the measured points, which is how a
forward's cost grows), T_D over 1 token with a cache of ``budget`` positions. The cache holds
``prefix`` committed positions; its capacity is fixed per batch (one compile per batch and block
size) and the kernel reads only each row's length.

KV memory is ``2 * 32 layers * 8 heads * 128 * 2 bytes = 128 KiB`` per token: a (batch, prefix)
whose cache does not fit ``--kv-gib`` next to the 16 GB of weights is not measured; the JSON
gives the analytic estimate (``cost_model.analytic_times``: bytes over HBM bandwidth, FLOPs over
peak, with the H200's 4.8 TB/s and 989 TFLOP/s scaled by the efficiencies measured on the
third of the measured points with the most KV) instead, marked ``"source": "analytic"``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import metadata, write
from benchmarks.shapes import LLAMA31_8B
from benchmarks.shapes import SMOKE as SMOKE_SHAPE
from jaxspec.measure import cost_model

SMOKE = dataclasses.replace(SMOKE_SHAPE, vocab_size=256, head_dim=64, max_position_embeddings=8192)
H200_BW, H200_FLOPS = 4.8e12, 989e12
BLOCKS = (1, 2, 4, 8)  # tokens per forward measured: T_T, T_V(1), T_V(3), T_V(7)
GAMMAS = range(1, 9)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32,64,128")
    p.add_argument("--prefixes", default="1024,4096,8192,16384,32768")
    p.add_argument("--budget", type=int, default=512, help="the draft's KV budget")
    p.add_argument("--alpha", type=float, default=0.8)
    p.add_argument("--kv-gib", type=float, default=100.0, help="KV cache memory allowed (GiB)")
    p.add_argument("--reps", type=int, default=3, help="timed pairs per forward (loop_ms)")
    p.add_argument("--loop", type=int, default=8, help="forwards per timed on-device loop")
    p.add_argument("--budget-s", type=float, default=200.0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="compile threads")
    p.add_argument("--smoke", action="store_true", help="a tiny model (CPU check of the script)")
    p.add_argument("--out", default=None, help="default: benchmarks/results/magicdec_8b.json")
    return p.parse_args(argv)


def log(t0, msg):
    print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)


def forward_fn(graphdef):
    """k forwards of t tokens per row after ``length`` committed positions in one on-device
    loop (``timing.repeat``), the cache donated and its length kept (so steps repeat); the
    argmax tokens are summed into the state, which keeps the LM head in the program."""
    from jaxspec.model.kv_cache import causal_block
    from jaxspec.model.transformer import apply
    from jaxspec.timing import repeat

    def fwd(state, params, tokens):
        cache, acc = state
        b, t = tokens.shape
        block = causal_block(cache.length, cache.length, jnp.full((b,), t, jnp.int32), t)
        logits, new = apply(graphdef, params, tokens, cache, block)
        new.length = cache.length
        return new, acc + jnp.argmax(logits, -1).sum(axis=1, dtype=jnp.int32)

    return jax.jit(repeat(fwd), donate_argnums=(0,))


def time_forward(exe, params, cache, tokens, args):
    """(ms per forward back to back on the device, the cache): ``timing.loop_ms_consuming``,
    the cache handed from call to call (no copy: the largest caches fit only once)."""
    from jaxspec.timing import loop_ms_consuming

    acc = jnp.zeros((tokens.shape[0],), jnp.int32)
    ms, (cache, _) = loop_ms_consuming(
        exe, (cache, acc), params, tokens, n=args.loop, reps=args.reps
    )
    return ms, cache


def interpolate(measured: dict[int, float], tokens: int) -> float:
    """Linear interpolation of a forward's time in its number of tokens."""
    ts = sorted(measured)
    if tokens in measured:
        return measured[tokens]
    hi = next((t for t in ts if t > tokens), ts[-1])
    lo = max((t for t in ts if t < tokens), default=ts[0])
    if hi == lo:
        return measured[lo]
    return measured[lo] + (measured[hi] - measured[lo]) * (tokens - lo) / (hi - lo)


def predicted(t_t, t_d, t_v_by_tokens, alpha):
    t_v = {g: interpolate(t_v_by_tokens, g + 1) for g in GAMMAS}
    gamma, speedup = cost_model.choose_gamma(t_d, t_t, t_v, alpha)
    return gamma, speedup, t_v


def main(argv=None) -> int:
    args = parse(argv)
    t0 = time.perf_counter()
    from jaxspec.model.kv_cache import KVCache
    from jaxspec.model.transformer import new_model

    cfg = SMOKE if args.smoke else LLAMA31_8B
    dtype = jnp.bfloat16
    model = new_model(cfg, seed=0, dtype=dtype)
    params, graphdef = jax.block_until_ready(model.params), model.graphdef
    log(
        t0,
        f"random {'smoke' if args.smoke else 'Llama-3.1-8B'}-shape weights on {jax.devices()[0]}",
    )
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    batches, prefixes = ints(args.batches), sorted(ints(args.prefixes))
    room = max(BLOCKS)
    dcap = args.budget + room
    plan = {}  # batch -> capacity (the largest prefix that fits) or None
    for b in batches:
        fits = [s for s in prefixes if b * (s + room) * per_token <= args.kv_gib * 2**30]
        plan[b] = max(fits) + room if fits else None

    def kv(b, capacity):
        shape = (b, capacity, cfg.num_kv_heads, cfg.head_dim)
        return KVCache(
            [jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
            [jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
            jnp.zeros((b,), jnp.int32),
        )

    # every executable first (lowered here, compiled on a pool; nothing is timed while anything
    # compiles): per batch one per block size, one for the draft
    pool = concurrent.futures.ThreadPoolExecutor(args.threads)
    futures = {}
    fwd = forward_fn(graphdef)
    k_a = jax.ShapeDtypeStruct((), jnp.int32)
    for b in batches:
        if plan[b] is None:
            continue
        futures[b] = {}
        acc_a = jax.ShapeDtypeStruct((b,), jnp.int32)
        for name, capacity, t in [*((t, plan[b], t) for t in BLOCKS), ("draft", dcap, 1)]:
            cache_a = jax.eval_shape(lambda b=b, c=capacity: kv(b, c))
            tok_a = jax.ShapeDtypeStruct((b, t), jnp.int32)
            lowered = fwd.lower((cache_a, acc_a), k_a, params, tok_a)
            futures[b][name] = pool.submit(lowered.compile)
        log(t0, f"batch {b}: lowered (cache capacity {plan[b]})")
    executables = {b: {k: f.result() for k, f in fs.items()} for b, fs in futures.items()}
    pool.shutdown()
    log(t0, "all compiled")

    meta = metadata()
    meta["command"] = "python " + " ".join(sys.argv)
    result = {
        **meta,
        "model": "Llama-3.1-8B shape (random bf16 weights; RoPE scaling left out: no effect on "
        "time)"
        if not args.smoke
        else "smoke",
        "draft": f"self-streaming (the target over a {args.budget}-token StreamingLLM cache)",
        "alpha": args.alpha,
        "kv_bytes_per_token": per_token,
        "kv_gib_allowed": args.kv_gib,
        "measured_blocks": list(BLOCKS),
        "note": "T_V for gammas other than 1, 3, 7 interpolated linearly in tokens; rows with "
        "source 'analytic' use cost_model.analytic_times with H200 bandwidth and peak scaled by "
        "the efficiency measured on the rows that fit",
        "rows": [],
        "not_run": [],
    }

    def save():
        result["elapsed_s"] = round(time.perf_counter() - t0, 1)
        write("magicdec_8b.json", result, args.out)

    rng = np.random.RandomState(0)
    measured_eff = []  # (analytic / measured T_T, T_D, KV tokens): scales the analytic rows
    for b in batches:
        if plan[b] is None or time.perf_counter() - t0 > args.budget_s:
            continue
        exe = executables.pop(b)
        toks = {t: jnp.asarray(rng.randint(0, cfg.vocab_size, (b, t)), jnp.int32) for t in BLOCKS}
        dcache = kv(b, dcap)
        dcache.length = jnp.full((b,), args.budget, jnp.int32)
        t_d, dcache = time_forward(exe["draft"], params, dcache, toks[1], args)
        del dcache
        cache = kv(b, plan[b])
        for s in prefixes:
            if s + room > plan[b]:
                continue
            if time.perf_counter() - t0 > args.budget_s:
                result["not_run"].append({"batch": b, "prefix": s, "why": "--budget-s reached"})
                continue
            cache.length = jnp.full((b,), s, jnp.int32)
            times = {}
            for t in BLOCKS:
                times[t], cache = time_forward(exe[t], params, cache, toks[t], args)
            t_t = times[1]
            gamma, speedup, t_v = predicted(t_t, t_d, times, args.alpha)
            an = cost_model.analytic_times(
                cfg, b, s, args.budget, 1, H200_BW, H200_FLOPS, dtype_bytes=2
            )
            measured_eff.append((an["t_t"] / t_t, an["t_d"] / t_d, b * s))
            row = {
                "batch": b,
                "prefix": s,
                "source": "measured",
                "t_t_ms": t_t,
                "t_d_ms": t_d,
                "t_v_ms": {g: t_v[g] for g in GAMMAS},
                "t_d_over_t_t": t_d / t_t,
                "t_v_over_t_t": {g: t_v[g] / t_t for g in GAMMAS},
                "measured_forward_ms": times,
                "gamma": gamma,
                "predicted_speedup": speedup,
                "analytic_t_t_ms": an["t_t"],
                "analytic_t_d_ms": an["t_d"],
            }
            result["rows"].append(row)
            save()
            log(
                t0,
                f"batch {b:>3} prefix {s:>6}: T_T {t_t:.3f} ms, T_D/T_T {t_d / t_t:.3f}, "
                f"T_V/T_T "
                + " ".join(f"{g}:{t_v[g] / t_t:.2f}" for g in (1, 3, 7))
                + f" -> gamma {gamma}, predicted {speedup:.2f}x at alpha {args.alpha}",
            )
        del cache

    # the (batch, prefix) points that did not fit: analytic, scaled by measured efficiency
    # efficiency from the measured points with the most KV (the regime of those that did not fit)
    top = sorted(measured_eff, key=lambda e: -e[2])[: max(1, len(measured_eff) // 3)]
    eff_t = float(np.median([e[0] for e in top])) if top else 1.0
    eff_d = float(np.median([e[1] for e in top])) if top else 1.0
    result["analytic_efficiency"] = {"t_t": eff_t, "t_d": eff_d}
    done = {(r["batch"], r["prefix"]) for r in result["rows"]}
    for b in batches:
        for s in prefixes:
            if (b, s) in done:
                continue
            raw = {
                g: cost_model.analytic_times(
                    cfg, b, s, args.budget, g, H200_BW, H200_FLOPS, dtype_bytes=2
                )
                for g in GAMMAS
            }
            t_t = raw[1]["t_t"] / eff_t
            t_d = raw[1]["t_d"] / eff_d
            t_v = {g: raw[g]["t_v"] / eff_t for g in GAMMAS}
            gamma, speedup = cost_model.choose_gamma(t_d, t_t, t_v, args.alpha)
            result["rows"].append(
                {
                    "batch": b,
                    "prefix": s,
                    "source": "analytic",
                    "t_t_ms": t_t,
                    "t_d_ms": t_d,
                    "t_v_ms": t_v,
                    "t_d_over_t_t": t_d / t_t,
                    "t_v_over_t_t": {g: t_v[g] / t_t for g in GAMMAS},
                    "gamma": gamma,
                    "predicted_speedup": speedup,
                }
            )
    result["rows"].sort(key=lambda r: (r["batch"], r["prefix"]))
    save()
    print(f"\n{'batch':>5} {'prefix':>6} {'source':>8} {'T_D/T_T':>8} {'T_V(3)/T_T':>10} "
          f"{'gamma':>5} {'speedup':>8}")  # fmt: skip
    for r in result["rows"]:
        print(
            f"{r['batch']:>5} {r['prefix']:>6} {r['source']:>8} {r['t_d_over_t_t']:>8.3f} "
            f"{r['t_v_over_t_t'][3]:>10.3f} {r['gamma']:>5} {r['predicted_speedup']:>7.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
