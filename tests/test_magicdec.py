"""MagicDec: sparse-KV drafts (SnapKV, StreamingLLM) against direct numpy selections, the cost
model against hand-computed numbers, and the engine's greedy output against autoregressive
decoding for ragged batches, prompts shorter and longer than the budget, and per-row EOS."""

import dataclasses
import functools
import re
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import api
from jaxspec.api import generate
from jaxspec.config import ModelConfig
from jaxspec.engines import base, chain, magicdec, programs
from jaxspec.errors import DraftError, OptionError
from jaxspec.measure import cost_model, units
from jaxspec.model.kv_cache import KVCache, init_cache
from jaxspec.model.prefill import pad_prompts, prefill
from jaxspec.spec import drafts, snapkv
from jaxspec.spec.sampling import Sampling
from tests import tiny

NEW = 20
BUDGET = 24  # snapkv: 8 selected + a ring of 16; streaming: 2 sinks + a ring of 22
LENS8 = (60, 2, 33, 24, 25, 9, 47, 17)  # shorter than, equal to and longer than the budget


# ------------------------------------------------------------------------------- selections


def numpy_snapkv(q, k, lens, budget, window, kernel, kind):
    """Direct SnapKV for one layer: (scores [b, kh, s], src [b, budget, kh], ok [b, budget])."""
    b, o, h, hd = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = h // kh
    sc = np.zeros((b, kh, s))
    src = np.zeros((b, budget, kh), np.int64)
    ok = np.zeros((b, budget), bool)
    f = budget - window
    for r in range(b):
        length = int(lens[r])
        n = min(o, length)
        start = length - n
        for t in range(n):
            for head in range(h):
                j = head // g
                logit = k[r, : start + t + 1, j] @ q[r, t, head] / np.sqrt(hd)
                w = np.exp(logit - logit.max())
                sc[r, j, : start + t + 1] += w / w.sum()
        if length <= budget:
            src[r] = np.arange(budget)[:, None]
            ok[r] = np.arange(budget) < length
            continue
        ok[r] = True
        c = length - window
        pad = kernel // 2
        for j in range(kh):
            pooled = np.array(
                [
                    (np.max if kind == "max" else lambda x: np.sum(x) / kernel)(
                        sc[r, j, max(p - pad, 0) : min(p + pad + 1, c)]
                    )
                    for p in range(c)
                ]
            )
            src[r, :f, j] = np.sort(np.argsort(-pooled, kind="stable")[:f])
        for pos in range(length - window, length):
            src[r, f + (pos - f) % window] = pos
    return sc, src, ok


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_snapkv_selection_matches_numpy(kind):
    rng = np.random.RandomState(0)
    b, o, h, kh, hd, s = 4, 6, 4, 2, 8, 40
    budget, window = 20, 8
    q = rng.randn(b, o, h, hd).astype(np.float32)
    k = rng.randn(b, s, kh, hd).astype(np.float32)
    lens = np.array([40, 3, 20, 29])  # long, shorter than obs, == budget, long
    sc = snapkv.scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(lens))
    cand = jnp.arange(s)[None, :] < jnp.asarray(lens - window)[:, None]
    pooled = snapkv.pool(sc, cand, 5, kind)
    src, ok = snapkv.select(pooled, jnp.asarray(lens), budget, window)
    ref_sc, ref_src, ref_ok = numpy_snapkv(q, k, lens, budget, window, 5, kind)
    np.testing.assert_allclose(np.asarray(sc), ref_sc, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(ok), ref_ok)
    np.testing.assert_array_equal(
        np.where(ref_ok[..., None], np.asarray(src), 0), ref_src * ref_ok[..., None]
    )
    # KV heads keep different positions, and gather moves each head's own keys
    assert (ref_src[0, :12, 0] != ref_src[0, :12, 1]).any()
    dense = KVCache([jnp.asarray(k)], [jnp.asarray(-k)], jnp.asarray(lens, jnp.int32))
    out = snapkv.gather(dense, [src], ok, room=3, budget=budget)
    want = np.take_along_axis(k, ref_src[..., None], axis=1) * ref_ok[..., None, None]
    np.testing.assert_array_equal(np.asarray(out.k[0][:, :budget]), want)
    np.testing.assert_array_equal(np.asarray(out.v[0][:, :budget]), -want)
    assert out.k[0].shape[1] == budget + 3
    np.testing.assert_array_equal(np.asarray(out.length), np.minimum(lens, budget))


def test_streaming_selection_matches_numpy():
    rng = np.random.RandomState(1)
    sp = drafts.Streaming(sinks=3, window=7)
    lens = np.array([30, 4, 10, 11, 17])
    k = rng.randn(5, 32, 2, 4).astype(np.float32)
    dense = KVCache([jnp.asarray(k)], [jnp.asarray(2 * k)], jnp.asarray(lens, jnp.int32))
    out = drafts._gather_streaming(dense, jnp.asarray(lens), sp, room=2)
    want = np.zeros((5, 12, 2, 4), np.float32)
    for r, n in enumerate(lens):
        if n <= sp.budget:
            want[r, :n] = k[r, :n]
            continue
        want[r, : sp.sinks] = k[r, : sp.sinks]
        for j in range(n - sp.window, n):
            want[r, sp.sinks + (j - sp.sinks) % sp.window] = k[r, j]
    np.testing.assert_array_equal(np.asarray(out.k[0]), want)
    np.testing.assert_array_equal(np.asarray(out.v[0]), 2 * want)
    np.testing.assert_array_equal(np.asarray(out.length), np.minimum(lens, sp.budget))


def test_snapkv_prompt_cache_on_a_model():
    """Window queries re-run over the prompt cache equal a from-scratch forward's, and the
    draft's cache holds exactly the numpy selection over them."""
    target = tiny.model(3)
    ps = tiny.prompts(3, lengths=(40, 5, 30))
    net, flat = target.net(), target.flat
    ids, lens = map(jnp.asarray, pad_prompts(ps, net.kernels))
    cache = init_cache(target.config, 3, ids.shape[1])
    dense = jax.jit(lambda p, c: prefill(net, p, c, ids, lens)[1])(flat, cache)
    queries = jax.jit(snapkv.window_queries, static_argnums=(0, 5))
    qs = queries(net, flat, dense, ids, lens, 6)
    full = queries(net, flat, dense, ids, lens, ids.shape[1])
    for r, n in enumerate(np.asarray(lens)):
        m = min(6, n)
        for a, c in zip(qs, full, strict=True):
            np.testing.assert_allclose(a[r, :m], c[r, n - m : n], rtol=1e-4, atol=1e-5)
    sp = drafts.SnapKV(sinks=8, window=16, obs=6)
    d = drafts.ModelDraft(net, sp, reuse_target_cache=True)
    pre = drafts.Prefill(ids, lens, dense, ids.shape[1] + 10, 4)
    got = jax.jit(lambda p, pre: drafts.prompt_cache(d, p, pre, room=4))(flat, pre)
    for layer, q in enumerate(qs):
        k = np.asarray(dense.k[layer])
        _, src, ok = numpy_snapkv(np.asarray(q), k, np.asarray(lens), 24, 16, 5, "max")
        want = np.take_along_axis(k, src[..., None], axis=1) * ok[..., None, None]
        np.testing.assert_array_equal(np.asarray(got.k[layer][:, :24]), want)


# ------------------------------------------------------------------------------- cost model


def test_cost_model_hand_numbers():
    assert cost_model.omega(3, 0.8) == pytest.approx((1 - 0.8**4) / 0.2) == pytest.approx(2.952)
    assert cost_model.omega(3, 1.0) == 4.0
    assert cost_model.omega(2, 0.0) == 1.0
    # T_T = 10, T_D = 1, T_V(g) = 10 + g, alpha = 0.8: ratio(g) = (1 + 0.2 g) / Omega(g)
    # g=3: 1.6 / 2.952 = 0.54201; g=4: 1.8 / 3.3616 = 0.53546 (best); g=5: 2.0 / 3.68928
    assert cost_model.relative_time(3, 0.8, 1.0, 10.0, 13.0) == pytest.approx(1.6 / 2.952)
    g, speedup = cost_model.choose_gamma(1.0, 10.0, lambda g: 10.0 + g, 0.8)
    assert g == 4 and speedup == pytest.approx(3.3616 / 1.8)
    g, speedup = cost_model.choose_gamma(1.0, 10.0, {1: 11.0, 2: 12.0, 3: 13.0}, 0.8)
    assert g == 3 and speedup == pytest.approx(2.952 / 1.6)
    # a draft as slow as the target never pays: gamma 1 at 1 / ((1 + 1.1) / 1.8)
    assert cost_model.choose_gamma(10.0, 10.0, lambda g: 11.0, 0.8) == (1, pytest.approx(1.8 / 2.1))
    assert cost_model.alpha_from_acceptance_length(2.952, 3) == pytest.approx(0.8, abs=1e-9)
    assert cost_model.alpha_from_acceptance_length(4.0, 3) == 1.0
    assert cost_model.alpha_from_acceptance_length(1.0, 3) == 0.0


def test_cost_model_chooses_for_the_slowest_row():
    # T_T = 10, T_D = 2, T_V(g) = 10 + g; alpha measured at gamma 2.
    # Mean row: 2.71 tokens a verify = 1 + a + a^2 -> alpha 0.9; gamma 4 is best:
    #   g=4: (0.8 + 1.4) / Omega(4, 0.9) = 2.2 / 4.0951 -> 1.8614x
    # Slowest row: 1.6 tokens -> a = (sqrt(3.4) - 1) / 2 = 0.42195; gamma 1 is best:
    #   g=1: 1.3 / 1.42195 -> 1.0938x; g=2: 1.6 / 1.6 -> 1.0x; g=4: 2.2 / 1.70688 -> 0.7758x
    t_v = {1: 11.0, 2: 12.0, 4: 14.0}
    mean = cost_model.Measurement(128, 2048, 10.0, 2.0, t_v, 0.9, 2, 2.71)
    assert mean.batch_alpha == 0.9
    assert mean.choose() == (4, pytest.approx(4.0951 / 2.2, rel=1e-4))
    m = cost_model.Measurement(128, 2048, 10.0, 2.0, t_v, 0.9, 2, 2.71, slowest_length=1.6)
    assert m.batch_alpha == pytest.approx((3.4**0.5 - 1) / 2, abs=1e-9)
    assert m.choose() == (1, pytest.approx(1.42195 / 1.3, rel=1e-4))
    assert cost_model.slowest_row_length([6, 12, 0], [3, 4, 0]) == 2.0  # idle rows ignored
    # the tree term also waits for its slowest row: (3 * 1 / 10 + 12 / 10) / L
    tree = cost_model.TreeMeasurement(3, 4, 2, 8, 1.0, 12.0, 4.0, slowest_length=2.5)
    assert tree.relative_time(10.0) == pytest.approx(1.5 / 2.5)


def test_analytic_times_hand_numbers():
    cfg = ModelConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    # per layer: q,o 2*64*64 + k,v 2*64*32 + mlp 3*64*128 = 36864; head 64000
    assert cost_model.param_counts(cfg) == (64000 + 2 * (36864 + 128) + 64 + 64000, 137728)
    t = cost_model.analytic_times(cfg, 4, 1000, 100, 3, 1e9, 1e10)
    # T_T: bytes (202048 + 2*2*4*1000*2*16) * 2 = 1428096 -> 1.428096 ms (FLOPs: 0.315 ms)
    assert t["t_t"] == pytest.approx(1.428096)
    # T_D: 100 cached positions: (202048 + 51200) * 2 bytes = 0.506496 ms
    assert t["t_d"] == pytest.approx(0.506496)
    # T_V(3): 4 tokens, still bandwidth-bound (FLOPs 12599296 -> 1.26 ms)
    assert t["t_v"] == pytest.approx(1.428096)
    # T_V(7): 8 tokens: 2*4*8*137728 + 4*2*4*8*1000*64 = 25198592 FLOPs -> 2.5198592 ms
    t7 = cost_model.analytic_times(cfg, 4, 1000, 100, 7, 1e9, 1e10)
    assert t7["t_v"] == pytest.approx(2.5198592)
    small = dataclasses.replace(cfg, num_layers=1)
    t_small = cost_model.analytic_times(cfg, 4, 1000, 100, 3, 1e9, 1e10, draft_cfg=small)
    assert t_small["t_d"] < t["t_d"]


def test_draft_step_costs_the_budget_not_the_context():
    """The cost model's timed draft step (the chain engine's "draft" unit with a self-draft, k
    of them in one loop, as ``measure.units`` runs it) compiles to the same draft work at any
    target context: the draft's cache is the budget's, and no cache-sized copy is made."""
    target = tiny.model(0)
    options = magicdec.Options(gamma=1, budget=BUDGET)
    d, dw = magicdec.resolve_draft(target, "self-streaming", options, None)
    costs = []
    for prefix in (64, 512):
        req = base.Request(2, prefix, 2, Sampling(), ())
        prog, _ = chain.ENGINE.program(
            target, None, magicdec.chain_options(options, 1), req, None, resolved=(d, dw)
        )
        room = prog.gamma + 2
        ids = jax.ShapeDtypeStruct((2, prefix), jnp.int32)
        lens = jax.ShapeDtypeStruct((2,), jnp.int32)
        seed = jax.ShapeDtypeStruct((), jnp.uint32)
        s = jax.eval_shape(
            lambda *a, prog=prog: chain.init(prog, *a), target.flat, dw.flat, ids, lens, seed
        )
        assert s.draft.cache.capacity == BUDGET + room
        assert s.cache.capacity >= prefix  # the target's cache does grow with the context
        unit = chain.ENGINE.units(prog)["draft"]
        k = jax.ShapeDtypeStruct((), jnp.int32)
        exe = (
            jax.jit(units._looped, static_argnums=0, donate_argnums=1)
            .lower((unit, prog), s, k, target.flat, dw.flat, None)
            .compile()
        )
        text = exe.as_text()
        costs.append(exe.cost_analysis()["bytes accessed"])
        assert not re.search(rf"\[2,{BUDGET + room},\d+,\d+\]\S* copy\(", text)
        cap = s.cache.capacity
        assert not re.search(rf"\[2,{cap},\d+,\d+\]\S* copy\(", text)
    assert costs[0] == costs[1]


# ------------------------------------------------------------------------------- engine


def reference(target, ps, new=NEW):
    return generate(target, ps, max_new_tokens=new).tokens


def eos_target(seed, ps):
    """The tiny target with an EOS that ends rows at different steps (some never)."""
    base = tiny.model(seed)
    ref = reference(base, ps)
    counts = {}
    for row in ref:
        for i, t in enumerate(row):
            counts.setdefault(t, set()).add(i)
    eos = max(counts, key=lambda t: (len(counts[t]), -t))
    return tiny.with_eos(base, eos)


KINDS = {
    "self-snapkv": lambda t: ("self-snapkv", {}),
    "self-streaming": lambda t: ("self-streaming", {"sinks": 2}),
    "model-snapkv": lambda t: (tiny.perturbed(t, 0.2, 7), {"sparse": "snapkv", "obs": 8}),
    "model-streaming": lambda t: (tiny.perturbed(t, 0.2, 7), {"sparse": "streaming"}),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_magicdec_greedy_equals_autoregressive_ragged_eos(kind):
    ps = tiny.prompts(0, lengths=LENS8)
    target = eos_target(0, ps)
    ref = reference(target, ps)
    ends = sorted(len(r) for r in ref)
    assert ends[0] < ends[-2] < NEW or ends[0] < ends[1] < NEW  # EOS at different steps
    draft, opts = KINDS[kind](target)
    r = generate(
        target,
        ps,
        draft=draft,
        method="magicdec",
        gamma=3,
        max_new_tokens=NEW,
        budget=BUDGET,
        **opts,
    )
    assert r.tokens == ref
    assert r.stats["gamma"] == 3 and r.stats["budget"] == BUDGET
    assert 1.0 < r.stats["acceptance_length"] <= 4.0
    assert r.stats["alpha"] == pytest.approx(
        cost_model.alpha_from_acceptance_length(r.stats["acceptance_length"], 3)
    )


@pytest.mark.parametrize("lengths", [(50,), (3, 41, 26, 11)])
def test_magicdec_snapkv_batch_sizes(lengths):
    for seed in range(3):
        target, ps = tiny.model(seed), tiny.prompts(seed, lengths=lengths)
        r = generate(
            target, ps, draft="self-snapkv", method="magicdec", gamma=2, max_new_tokens=NEW,
            budget=BUDGET, obs=4, pool="avg",
        )  # fmt: skip
        assert r.tokens == reference(target, ps), seed


def _long_call(monkeypatch) -> None:
    """Every call counts as long enough for another gamma to repay its compile: the CPU's plan
    then times T_D and T_V (a tiny model's calls never are: its tokens take microseconds)."""
    monkeypatch.setattr(cost_model.Measurement, "settles", lambda self, tokens: False)


def test_magicdec_auto_gamma(monkeypatch):
    monkeypatch.setattr(magicdec, "candidate_gammas", lambda backend=None: (2, 3))
    _long_call(monkeypatch)
    target, ps = tiny.model(5), tiny.prompts(5, lengths=(30, 12))
    r = generate(
        target, ps, draft=target, sparse="dense", method="magicdec", shape="chain",
        max_new_tokens=NEW,
    )  # fmt: skip
    assert r.tokens == reference(target, ps)
    assert r.stats["gamma"] in (2, 3)
    cm = r.stats["cost_model"]
    assert cm["alpha"] == 1.0  # the target is its own dense draft
    assert set(cm["t_v_ms"]) == {2, 3} and cm["t_d_ms"] > 0
    assert cm["prefix_bucket"] == 32
    # a CPU leaves T_T out (no choice depends on it): no speedup over autoregressive decoding
    assert cm["t_t_ms"] is None and r.stats["predicted_speedup"] is None


def test_cost_model_plans_and_the_line_of_t_v():
    cpu = cost_model.plan((1, 2, 4), "cpu")
    assert (cpu.timed, cpu.t_t, cpu.alpha_gamma, cpu.on_call) == ((1, 4), None, 1, True)
    assert cpu.t_v_from_loop and not cost_model.Plan().t_v_from_loop
    assert cost_model.plan((1, 2), "cpu").timed == (1, 2)
    gpu = cost_model.plan(range(1, 9), "gpu")  # a GPU times every term, T_T the AR step
    assert gpu == cost_model.Plan() and gpu.timed is None and gpu.t_t == "autoregressive"
    assert cost_model.interpolate({1: 40.0, 4: 55.0}, (1, 2, 3, 4)) == {
        1: 40.0, 2: 45.0, 3: 50.0, 4: 55.0,
    }  # fmt: skip
    with pytest.raises(ValueError, match="outside"):
        cost_model.interpolate({1: 40.0, 4: 55.0}, (1, 4, 5))


def test_a_loop_iteration_is_timed_over_the_iterations_it_ran():
    """``_iteration_ms``: (3 iterations - 1) / 2 from fresh copies of the state, whatever one
    call costs besides; None when no iteration ran between them (every row done)."""
    calls = []

    def seg(tflat, dflat, state, limit, per_ms=20.0, base_ms=60.0, stop_at=99):
        ran = min(int(limit), stop_at)
        calls.append(np.asarray(state).copy())
        time.sleep((base_ms + per_ms * ran) / 1e3)
        return state, types.SimpleNamespace(steps=np.int32(ran))

    state = np.arange(3, dtype=np.float32)
    ms = cost_model._iteration_ms(seg, None, None, state)
    assert 15.0 < ms < 30.0  # 20 ms an iteration; the 60 ms a call cancels (3 calls: 40)
    assert all((c == state).all() for c in calls)  # each from a copy of the state
    done = functools.partial(seg, stop_at=1)
    assert cost_model._iteration_ms(done, None, None, state) is None


def _compiles(monkeypatch) -> list[str]:
    """The names of the programs compiled from now on (into an emptied compile cache)."""
    names: list[str] = []
    keep = programs._keep

    def counted(full, exe, seconds):
        names.append(full[0].__name__)
        keep(full, exe, seconds)

    monkeypatch.setattr(programs, "_COMPILED", type(programs._COMPILED)())
    monkeypatch.setattr(programs, "_keep", counted)
    return names


def _auto_run(target, ps, streamed: bool, opts: dict):
    """A magicdec call through ``generate``, or streamed through ``api.stream``: its result."""
    if not streamed:
        return generate(target, ps, **opts)
    s = api.stream(target, ps, **opts)
    assert list(s)
    return s.result


@pytest.mark.parametrize("streamed", [True, False])
def test_magicdec_auto_on_a_cpu_compiles_only_what_it_times(monkeypatch, streamed):
    """gamma="auto" on a CPU (candidates 1, 2, 4) compiles the call's own loop at gamma 1, where
    alpha is measured, T_D and T_V at gamma 4; T_V(1) is one iteration of that loop less a T_D
    when the call is streamed (its prefill, whose state the units are timed on, and its segment:
    four programs), else a unit of its own (a call of at most 32 tokens: the whole loop, a
    prefill for the units and three units: five). T_V(2) is read off the line (the stats say
    so); no T_T. The run at gamma 1 then finds its programs compiled. (A call long enough
    for another gamma to repay its compile: a shorter one times no unit, below.)"""
    monkeypatch.setattr(magicdec, "candidate_gammas", lambda backend=None: (1, 2, 4))
    _long_call(monkeypatch)
    target, ps = tiny.model(5), tiny.prompts(5, lengths=(30, 12))
    ref = reference(target, ps)
    names = _compiles(monkeypatch)
    opts = dict(draft="self-streaming", method="magicdec", max_new_tokens=NEW, budget=BUDGET)

    def run():
        return _auto_run(target, ps, streamed, opts)

    r = run()
    if streamed:
        assert sorted(names) == sorted(["_stream_init", "_looped", "_looped", "_stream_segment"])
    else:
        assert sorted(names) == sorted(["_init", "decode", *["_looped"] * 3])
    assert r.tokens == ref and r.stats["gamma"] == 1 and r.stats["compile_s"] == 0.0
    cm = r.stats["cost_model"]
    assert cm["t_v_interpolated"] == [2] and cm["t_t_ms"] is None
    t_v = cm["t_v_ms"]
    assert t_v[2] == pytest.approx(t_v[1] + (t_v[4] - t_v[1]) / 3)
    # a tiny model's gammas differ by microseconds a token: no other gamma repays a compile
    assert cm["best_gamma"] in (1, 2, 4) and cm["loop_compile_s"] > 0
    again = run()  # the profile kept: the same gamma, nothing compiled
    assert again.stats["gamma"] == 1 and again.stats["compile_s"] == 0.0 and again.tokens == ref
    assert len(names) == (4 if streamed else 5)


@pytest.mark.parametrize("streamed", [True, False])
def test_magicdec_auto_on_a_cpu_times_no_unit_for_a_call_too_short_to_repay_a_compile(
    monkeypatch, streamed
):
    """A call whose tokens take less time at the alpha gamma than another gamma's loop takes to
    compile runs at the alpha gamma whatever T_D and T_V are: the CPU's plan compiles only the
    call's own loop (streamed: its prefill and segment; else the whole loop), measures alpha on
    it and times no unit. The kept profile serves another short call as it is; a long call
    measures the units then, and keeps them. Every output is exactly greedy."""
    monkeypatch.setattr(magicdec, "candidate_gammas", lambda backend=None: (1, 2, 4))
    target, ps = tiny.model(5), tiny.prompts(5, lengths=(30, 12))
    names = _compiles(monkeypatch)
    # a length of its own: programs of the other tests' shapes would compile from JAX's
    # in-process cache in no time, and a loop that compiles in no time settles nothing
    new = NEW + 3
    opts = dict(draft="self-streaming", method="magicdec", max_new_tokens=new, budget=BUDGET)

    def run():
        return _auto_run(target, ps, streamed, opts)

    ref = reference(target, ps, new)
    names.clear()
    r = run()
    assert sorted(names) == (["_stream_init", "_stream_segment"] if streamed else ["decode"])
    cm = r.stats["cost_model"]
    assert r.tokens == ref and r.stats["gamma"] == 1 and r.stats["compile_s"] == 0.0
    assert not cm["units_timed"] and cm["t_d_ms"] is None and cm["t_v_ms"] == {}
    assert cm["best_gamma"] is None and 0 < cm["alpha"] <= 1
    assert 0 < cm["own_token_ms"] * new / 1e3 <= cm["loop_compile_s"]
    first_compile_s = cm["loop_compile_s"]
    again = run()
    assert again.tokens == ref and again.stats["gamma"] == 1 and len(names) == len(set(names))
    _long_call(monkeypatch)
    long = run()
    cm = long.stats["cost_model"]
    assert long.tokens == ref and long.stats["gamma"] == 1
    assert cm["units_timed"] and cm["t_d_ms"] > 0 and set(cm["t_v_ms"]) == {1, 2, 4}
    # it found the loop compiled by the first call, whose compile still prices a switch: a tiny
    # model's gammas differ by microseconds a token, so none repays it (CI once saw gamma 4
    # chosen when the long call priced the switch at its own 0 s)
    assert cm["loop_compile_s"] == first_compile_s
    assert names.count("_looped") == (2 if streamed else 3)  # T_D, T_V(4) (not streamed: T_V(1))


def test_a_measurement_settles_a_call_no_other_gamma_can_repay():
    m = cost_model.Measurement(1, 64, None, None, {}, 1.0, 1, 2.0, loop_compile_s=6.0,
                               own_token_ms=30.0)  # fmt: skip
    assert m.settles(200) and not m.settles(201)  # 200 x 30 ms = 6 s: nothing can save more
    assert not m.settles(None) and not dataclasses.replace(m, own_token_ms=None).settles(10)
    assert not m.timed_units
    _, chosen = cost_model._choice(magicdec.Options(shape="chain"), m, None, 100)
    assert chosen["chosen"] == {"shape": "chain", "gamma": 1}
    assert chosen["stats"]["cost_model"]["best_gamma"] is None


def test_magicdec_auto_times_t_v_as_a_unit_when_its_loop_ran_no_iteration(monkeypatch):
    """When the loop's timing finds no iteration to time (every row done at once), T_V at the
    alpha gamma is a unit of its own, compiled then; the output stays exactly greedy."""
    monkeypatch.setattr(magicdec, "candidate_gammas", lambda backend=None: (1, 2, 4))
    monkeypatch.setattr(cost_model, "_iteration_ms", lambda *a: None)
    _long_call(monkeypatch)
    target, ps = tiny.model(6), tiny.prompts(6, lengths=(30, 12))
    ref = reference(target, ps)
    names = _compiles(monkeypatch)
    s = api.stream(
        target, ps, draft="self-streaming", method="magicdec", max_new_tokens=NEW, budget=BUDGET
    )
    list(s)
    cm = s.result.stats["cost_model"]
    assert s.result.tokens == ref and set(cm["t_v_ms"]) == {1, 2, 4}
    assert sorted(names) == sorted(["_stream_init", "_stream_segment", *["_looped"] * 3])


def test_magicdec_auto_with_a_gpus_plan_times_every_term(monkeypatch):
    """A GPU's plan (run here on the CPU) times T_T (the autoregressive step), T_D and T_V at
    every candidate on random prompts of the bucket, and measures alpha at the middle gamma on
    the call's own streamed loop, which the run then finds compiled."""
    monkeypatch.setattr(magicdec, "candidate_gammas", lambda backend=None: (1, 2))
    monkeypatch.setattr(cost_model, "plan", lambda gammas: cost_model.Plan())
    target, ps = tiny.model(5), tiny.prompts(5, lengths=(30, 12))
    ref = reference(target, ps)
    names = _compiles(monkeypatch)
    s = api.stream(
        target, ps, draft="self-streaming", method="magicdec", max_new_tokens=NEW, budget=BUDGET
    )
    list(s)
    r = s.result
    assert sorted(names) == sorted(
        ["_init", "_init", "_stream_init", "_stream_segment", *["_looped"] * 4]
    )  # the AR and chain prefills, T_T, T_D, T_V(1, 2), the call's loop at gamma 2
    cm = r.stats["cost_model"]
    assert r.tokens == ref and cm["t_v_interpolated"] == [] and set(cm["t_v_ms"]) == {1, 2}
    assert cm["t_t_ms"] > 0 and r.stats["predicted_speedup"] > 0 and cm["alpha_gamma"] == 2
    assert r.stats["gamma"] == 2 and r.stats["compile_s"] == 0.0


def test_the_measuring_call_keeps_its_compiled_gamma_unless_another_repays_its_compile():
    m = cost_model.Measurement(
        1, 64, 10.0, 1.0, {1: 11.0, 2: 12.0, 4: 14.0}, 0.9, 1, 1.9, loop_compile_s=5.0
    )
    assert m.choose() == (4, pytest.approx(10.0 / (18.0 / magicdec.omega(4, 0.9))))
    # per token: gamma 1 costs 12 / 1.9 = 6.32 ms, gamma 4 18 / 4.095 = 4.40 ms; 5 s of compile
    # are repaid after 2604 tokens
    assert cost_model.compiled_pays(m, 4, 2700) and not cost_model.compiled_pays(m, 4, 2500)
    opts = magicdec.Options(shape="chain")
    assert cost_model._choice(opts, m, None, 100)[0].gamma == 1
    _, chosen = cost_model._choice(opts, m, None, 100)
    assert chosen["chosen"]["gamma"] == 1 and chosen["stats"]["cost_model"]["best_gamma"] == 4
    assert chosen["stats"]["predicted_speedup"] == pytest.approx(10.0 / (12.0 / 1.9))
    assert cost_model._choice(opts, m, None, 10_000)[0].gamma == 4
    assert cost_model._choice(opts, m, None, None)[0].gamma == 4  # a kept profile: nothing built
    no_t_t = dataclasses.replace(m, t_t=None)  # T_T scales every gamma alike: the same choices
    assert no_t_t.choose() == (4, None)
    _, chosen = cost_model._choice(opts, no_t_t, None, 100)
    assert chosen["chosen"]["gamma"] == 1 and chosen["stats"]["predicted_speedup"] is None


def test_magicdec_user_errors():
    target, ps = tiny.model(0), tiny.prompts(0)
    run = dict(method="magicdec", max_new_tokens=4)
    with pytest.raises(DraftError, match="chain"):
        generate(target, ps, draft="ngram", **run)
    with pytest.raises(OptionError, match="window"):
        generate(target, ps, draft="self-snapkv", gamma=20, budget=BUDGET, **run)
    with pytest.raises(OptionError, match="sparse"):
        generate(target, ps, draft="self-snapkv", sparse="snapkv", **run)
    with pytest.raises(OptionError, match="pool"):
        generate(target, ps, draft="self-snapkv", pool="min", **run)
    with pytest.raises(OptionError, match="does not take"):
        generate(target, ps, draft="self-snapkv", gama=3, **run)
    # prompt lookup's n-gram is a chain/tree option; magicdec's drafts have none (gamma given:
    # a run that wrongly accepted it would not measure the cost model first)
    with pytest.raises(OptionError, match="does not take"):
        generate(target, ps, draft="self-snapkv", gamma=2, ngram=3, **run)
    assert jax.devices()  # keeps the forced-devices conftest honest
