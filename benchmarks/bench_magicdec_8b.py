"""MagicDec's cost model for a Llama-3.1-8B-shape model (random bf16 weights made on the device):
measured T_T(B, S), T_D(B) (the target itself over a StreamingLLM cache of ``--budget`` tokens:
self-speculation) and T_V(B, S, gamma), their ratios to T_T, and the speedup the cost model
predicts at ``--alpha`` (0.8: MagicDec's measured acceptance at a 512 budget).

    python benchmarks/bench_magicdec_8b.py [--batches 1,8,32,64,128]
        [--prefixes 1024,4096,8192,16384,32768] [--kv-gib 100] [--budget-s 200]
        [--out benchmarks/results/magicdec_8b.json]

Every time is one of the engines' own units (``Engine.units``, timed by ``measure.units``: steps
back to back in an on-device loop with the state donated, so no host call's overhead counts), on
the programs ``generate`` builds (``common.fixed_call``), with the kernels of the ``JAXSPEC_*``
variables: T_T the autoregressive engine's decode step, T_V(gamma) the chain engine's verify of
gamma + 1 tokens (measured at gamma 1, 3 and 7; other gammas interpolated linearly in the number
of tokens, which is how a forward's cost grows), T_D its propose at gamma 1 with the draft's
cache full at ``budget`` positions. One init per program and batch (a prompt of ``budget``
tokens), then the target's cache is moved to each prefix (``Engine.shifted``): one compile per
batch and program, and the decode kernels read only each row's length.

KV memory is ``2 * 32 layers * 8 heads * 128 * 2 bytes = 128 KiB`` per token, and a unit runs on
a copy of its state: a (batch, prefix) whose two caches do not fit ``--kv-gib`` next to the 16 GB
of weights is not measured; the JSON gives the analytic estimate (``cost_model.analytic_times``:
bytes over HBM bandwidth, FLOPs over peak, with the H200's 4.8 TB/s and 989 TFLOP/s scaled by
the efficiencies measured on the third of the measured points with the most KV) instead, marked
``"source": "analytic"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    fixed_call,
    initial,
    ints,
    log,
    metadata,
    random_target,
    unit_ms,
    write,
)
from benchmarks.shapes import LLAMA31_8B  # noqa: E402
from benchmarks.shapes import SMOKE as SMOKE_SHAPE  # noqa: E402
from jaxspec.measure import cost_model  # noqa: E402

SMOKE = dataclasses.replace(SMOKE_SHAPE, vocab_size=256, head_dim=64, max_position_embeddings=8192)
H200_BW, H200_FLOPS = 4.8e12, 989e12
GAMMAS = range(1, 9)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32,64,128")
    p.add_argument("--prefixes", default="1024,4096,8192,16384,32768")
    p.add_argument("--budget", type=int, default=512, help="the draft's KV budget")
    p.add_argument("--alpha", type=float, default=0.8)
    p.add_argument("--kv-gib", type=float, default=100.0, help="KV cache memory allowed (GiB)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each unit timing")
    p.add_argument("--budget-s", type=float, default=200.0)
    p.add_argument("--smoke", action="store_true", help="a tiny model (CPU check of the script)")
    p.add_argument("--out", default=None, help="default: benchmarks/results/magicdec_8b.json")
    return p.parse_args(argv)


# (tokens a forward takes, the program that times it): T_T, T_V(1), T_V(3), T_V(7)
UNITS = {1: None, 2: 1, 4: 3, 8: 7}
ROOM = max(UNITS) + 2  # a verify block of 8 tokens and the chain engine's spare slot


def plan(cfg, batches, prefixes, kv_gib: float) -> dict:
    """batch -> the cache capacity its programs get (the largest prefix that fits, plus room),
    or None. A unit is timed on a copy of its state (``measure.units``), so two caches must fit
    ``kv_gib``."""
    per_token = kv_bytes_per_token(cfg)
    out = {}
    for b in batches:
        fits = [s for s in prefixes if 2 * b * (s + ROOM) * per_token <= kv_gib * 2**30]
        out[b] = max(fits) + ROOM if fits else None
    return out


def kv_bytes_per_token(cfg) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16


def measure_batch(target, b: int, prefixes: list[int], capacity: int, args, over) -> dict:
    """{prefix: {tokens: ms}} (T_T and T_V by block tokens) and T_D at batch ``b``: each the
    engine's unit (``measure.units``) on its program, at every prefix by ``Engine.shifted``
    from one init over a prompt of the draft's budget (its sparse cache then full)."""
    prompt = min(args.budget, min(prefixes))
    ids = np.random.RandomState(b).randint(0, target.config.vocab_size, (b, prompt))
    ids, lens = ids.astype(np.int32), np.full((b,), prompt, np.int32)
    max_new = capacity - prompt  # every program's cache holds the longest prefix and a block
    times: dict = {s: {} for s in prefixes}
    t_d = None
    for tokens, gamma in UNITS.items():
        if over():
            break
        if gamma is None:
            call = fixed_call(target, ids, lens, "autoregressive", max_new=max_new)
        else:
            call = fixed_call(
                target, ids, lens, "magicdec", draft="self-streaming", max_new=max_new,
                gamma=gamma, budget=args.budget,
            )  # fmt: skip
        s0 = initial(call)
        if gamma == 1:
            t_d = unit_ms(call, s0, "draft", args.reps)
        for s in prefixes:
            state = call.engine.shifted(call.prog, s0, s - prompt)
            times[s][tokens] = unit_ms(call, state, "verify", args.reps)
        del s0, state
    return {s: t for s, t in times.items() if len(t) == len(UNITS)}, t_d


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


def cost_row(b, s, source, t_t, t_d, t_v, alpha) -> dict:
    """A row's times, their ratios to T_T, and the cost model's gamma and predicted speedup."""
    gamma, speedup = cost_model.choose_gamma(t_d, t_t, t_v, alpha)
    return {
        "batch": b,
        "prefix": s,
        "source": source,
        "t_t_ms": t_t,
        "t_d_ms": t_d,
        "t_v_ms": t_v,
        "t_d_over_t_t": t_d / t_t,
        "t_v_over_t_t": {g: t_v[g] / t_t for g in GAMMAS},
        "gamma": gamma,
        "predicted_speedup": speedup,
    }


def measured_row(cfg, b, s, times: dict, t_d: float, args) -> dict:
    t_t = times[1]
    t_v = {g: interpolate(times, g + 1) for g in GAMMAS}
    an = cost_model.analytic_times(cfg, b, s, args.budget, 1, H200_BW, H200_FLOPS, dtype_bytes=2)
    row = cost_row(b, s, "measured", t_t, t_d, t_v, args.alpha)
    row.update(measured_forward_ms=times, analytic_t_t_ms=an["t_t"], analytic_t_d_ms=an["t_d"])
    return row


def analytic_rows(cfg, batches, prefixes, done: set, rows: list[dict], args) -> dict:
    """Rows for the (batch, prefix) points not measured: ``cost_model.analytic_times`` with the
    H200's bandwidth and peak scaled by the efficiency of the third of the measured points with
    the most KV (the regime of those that did not fit). Returns that efficiency."""
    top = sorted(rows, key=lambda r: -r["batch"] * r["prefix"])[: max(1, len(rows) // 3)]
    eff = [(r["analytic_t_t_ms"] / r["t_t_ms"], r["analytic_t_d_ms"] / r["t_d_ms"]) for r in top]
    eff_t = float(np.median([e[0] for e in eff])) if eff else 1.0
    eff_d = float(np.median([e[1] for e in eff])) if eff else 1.0
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
            t_v = {g: raw[g]["t_v"] / eff_t for g in GAMMAS}
            t_t, t_d = raw[1]["t_t"] / eff_t, raw[1]["t_d"] / eff_d
            rows.append(cost_row(b, s, "analytic", t_t, t_d, t_v, args.alpha))
    return {"t_t": eff_t, "t_d": eff_d}


def main(argv=None) -> int:
    args = parse(argv)
    t0 = time.perf_counter()
    cfg = SMOKE if args.smoke else LLAMA31_8B
    target = random_target(cfg, dtype=jnp.bfloat16)
    log(
        t0,
        f"random {'smoke' if args.smoke else 'Llama-3.1-8B'}-shape weights on {jax.devices()[0]}",
    )
    batches, prefixes = ints(args.batches), sorted(ints(args.prefixes))
    capacity = plan(cfg, batches, prefixes, args.kv_gib)
    result = {
        **metadata(),
        "model": "smoke"
        if args.smoke
        else "Llama-3.1-8B shape (random bf16 weights; RoPE scaling left out: no effect on time)",
        "draft": f"self-streaming (the target over a {args.budget}-token StreamingLLM cache)",
        "alpha": args.alpha,
        "kernels": target.net().kernels.describe(),
        "kv_bytes_per_token": kv_bytes_per_token(cfg),
        "kv_gib_allowed": args.kv_gib,
        "measured_blocks": list(UNITS),
        "note": "T_T: the autoregressive engine's decode step; T_V(gamma): the chain engine's "
        "verify (measured at gammas 1, 3, 7, the others interpolated linearly in tokens); T_D: its "
        "propose at gamma 1 (measure.units). Rows with source 'analytic' use "
        "cost_model.analytic_times with H200 bandwidth and peak scaled by the efficiency measured "
        "on the rows that fit",
        "rows": [],
        "not_run": [],
    }

    def over():
        return time.perf_counter() - t0 > args.budget_s

    def save():
        result["elapsed_s"] = round(time.perf_counter() - t0, 1)
        write("magicdec_8b.json", result, args.out)

    for b in batches:
        fit = [s for s in prefixes if capacity[b] is not None and s + ROOM <= capacity[b]]
        if not fit:
            continue
        if over():
            result["not_run"] += [
                {"batch": b, "prefix": s, "why": "--budget-s reached"} for s in fit
            ]
            continue
        times, t_d = measure_batch(target, b, fit, capacity[b], args, over)
        result["not_run"] += [
            {"batch": b, "prefix": s, "why": "--budget-s reached"} for s in fit if s not in times
        ]
        for s, ts in times.items():
            row = measured_row(cfg, b, s, ts, t_d, args)
            result["rows"].append(row)
            ratios = " ".join(f"{g}:{row['t_v_over_t_t'][g]:.2f}" for g in (1, 3, 7))
            log(
                t0,
                f"batch {b:>3} prefix {s:>6}: T_T {row['t_t_ms']:.3f} ms, T_D/T_T "
                f"{row['t_d_over_t_t']:.3f}, T_V/T_T {ratios} -> gamma {row['gamma']}, "
                f"predicted {row['predicted_speedup']:.2f}x",
            )
        save()
    done = {(r["batch"], r["prefix"]) for r in result["rows"]}
    measured = list(result["rows"])
    result["analytic_efficiency"] = analytic_rows(cfg, batches, prefixes, done, measured, args)
    result["rows"] = sorted(measured, key=lambda r: (r["batch"], r["prefix"]))
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
