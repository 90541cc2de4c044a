"""The fused RoPE + cache write + attention kernel (pallas_kernels/rope_attention.py) against its
unfused reference on fresh random inputs, and the model's greedy tokens with it.

As in test_kernels.py: on CPU the kernel runs through the Pallas interpreter, and cache slots
past the prefix are poisoned with NaN, so a kernel that reads the slots it writes (instead of
the new keys it holds) or reads past the prefix fails.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.model.kv_cache import causal_block
from jaxspec.spec.tree import NO_SLOT
from pallas_kernels import rope_attention as R
from tests.test_kernels import TOL, tree_masks

INTERPRET = jax.default_backend() != "gpu"


def make_inputs(seed, *, b, t, kh, g, s, hd, dtype, tree: bool, near_end: bool = False):
    rng = np.random.default_rng(seed)
    hi = s if near_end else s - t
    length = rng.integers(0, max(hi, 1), b).astype(np.int32)
    if near_end:  # some new tokens fall past the capacity: not written, not visible
        length[0] = s - 1
    valid = rng.integers(1, t + 1, b).astype(np.int32)
    blk = causal_block(jnp.asarray(length), jnp.asarray(length + 5), jnp.asarray(valid), t)
    slots, mask = np.asarray(blk.slots), np.asarray(blk.block_mask)
    if tree:  # a tree verify's block: ancestor masks, padding slots marked NO_SLOT
        real = np.arange(t)[None, :] < valid[:, None]
        mask = tree_masks(rng, b, t, t, valid)
        slots = np.where(real, length[:, None] + np.arange(t), NO_SLOT).astype(np.int32)
    qkv = rng.normal(size=(b, t, kh * g + 2 * kh, hd))  # query, key, value heads; before RoPE
    ang = rng.uniform(0, 50, (b, t, 1)) * np.linspace(1e-3, 1.0, hd // 2)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    kc, vc = rng.normal(size=(2, b, s, kh, hd))
    past = np.arange(s)[None, :] >= length[:, None]  # not yet written: poisoned
    k_bad, v_bad = kc.copy(), vc.copy()
    k_bad[past], v_bad[past] = np.nan, np.nan
    kc[past], vc[past] = 0.0, 0.0
    arr = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    common = (arr(qkv), jnp.asarray(cos), jnp.asarray(sin))
    tail = (jnp.asarray(length), jnp.asarray(slots), jnp.asarray(mask))
    return common + (arr(k_bad), arr(v_bad)) + tail, common + (arr(kc), arr(vc)) + tail


def copies(args):
    """Fresh buffers: the kernel donates its caches, and ``check`` reads the originals."""
    return [jnp.array(x) for x in args]


def check(got, want, poisoned, dtype):
    out, k, v = (np.asarray(x, np.float32) for x in got)
    r_out, r_k, r_v = (np.asarray(x, np.float32) for x in want)
    assert not np.isnan(out).any(), "NaN leaked into the output"
    np.testing.assert_allclose(out, r_out, atol=TOL[dtype], rtol=TOL[dtype])
    slots = np.asarray(poisoned[6])
    for cache, ref, before in ((k, r_k, poisoned[3]), (v, r_v, poisoned[4])):
        before = np.asarray(before, np.float32)
        written = np.zeros(before.shape[:2], bool)
        for row in range(before.shape[0]):
            ok = slots[row] < before.shape[1]
            written[row, slots[row][ok]] = True
        # the new slots hold the reference's rotated keys / values; nothing else changed
        np.testing.assert_allclose(cache[written], ref[written], atol=1e-6, rtol=1e-6)
        np.testing.assert_array_equal(cache[~written], before[~written])


@pytest.mark.parametrize(
    "t, g, s, hd, dtype, tree",
    [
        (1, 3, 37, 64, jnp.float32, False),  # a SmolLM2-like decode step (3 query heads per KV)
        (1, 4, 300, 128, jnp.bfloat16, False),
        (5, 1, 129, 64, jnp.float32, False),  # a chain verify, ragged valid rows
        (9, 3, 200, 64, jnp.float32, True),  # a tree verify (bs 8 + root)
        (9, 2, 77, 128, jnp.bfloat16, True),
    ],
)
def test_matches_the_unfused_path(t, g, s, hd, dtype, tree):
    for seed in range(2):
        poisoned, clean = make_inputs(seed, b=3, t=t, kh=2, g=g, s=s, hd=hd, dtype=dtype, tree=tree)
        got = R.rope_attention(*copies(poisoned), num_heads=2 * g, interpret=INTERPRET)
        check(got, R.reference(*clean, num_heads=2 * g), poisoned, dtype)


def test_split_bounds_apply_where_the_tile_leaves_the_split_length_open():
    """``min_split`` / ``max_splits`` (what ``fused_linear.combine_project`` asks for) set the
    splits' shortest length and their most, and the merged output is still the reference's; a
    tile's own ``min_split`` is kept as given, unbounded. ``plan``'s numbers for the SmolLM2 shape
    (the measured cases): at 4K 33 splits of 128 slots by default (``MIN_SPLIT``), 9 of 512 under
    a bound of 9, 17 of 256 with 256-slot splits; at 1K 9 of 128, 5 of 256; at 16K the bound of
    33 lengthens 128-slot splits to 512."""
    from pallas_kernels import decode_attention as D

    def plan(s, **k):
        p = D.plan(1, s, 3, 3, head_dim=64, **k)
        return p["k_splits"], p["split_len"]

    assert [plan(4136, max_splits=m) for m in (None, 9)] == [(33, 128), (9, 512)]
    assert plan(4136, min_split=256) == (17, 256)
    assert plan(4136, min_split=128, max_splits=33) == (33, 128)
    assert plan(1064) == (9, 128) and plan(1064, min_split=256) == (5, 256)
    assert plan(16424, min_split=128, max_splits=33) == (33, 512)
    poisoned, clean = make_inputs(7, b=2, t=1, kh=2, g=3, s=600, hd=64, dtype=jnp.float32,
                                  tree=False)  # fmt: skip
    want = R.reference(*clean, num_heads=6)
    cases = (
        (None, {}, 5),
        (None, {"max_splits": 2}, 2),
        (None, {"min_split": 256}, 3),
        ((None, None, 128), {"max_splits": 2}, 5),
        ((None, None, 512), {"min_split": 128, "max_splits": 4}, 2),
        ((None, 1, 128, 2), {}, 5),  # a four-entry tile (stages, warps): the same result
    )
    for tile, bounds, n in cases:
        split, k, v = R.rope_attention_splits(
            *copies(poisoned), num_heads=6, interpret=INTERPRET, tile=tile, **bounds
        )
        assert split.acc.shape[2] == n
        acc, m, ssum = (x[..., :3, :] if x.ndim == 5 else x[..., :3] for x in split)
        out = D.combine(acc, m, ssum, 1, jnp.float32)
        check((out, k, v), want, poisoned, jnp.float32)


def test_the_tile_s_stages_and_warps_reach_the_plan(monkeypatch):
    """``attention_tile``'s num_stages and num_warps are the kernel's compiler parameters
    (``decode_attention.plan``'s), not dropped on the way."""
    from pallas_kernels import decode_attention as D

    seen = []
    real = D.plan

    def spy(*args, **kw):
        out = real(*args, **kw)
        seen.append(
            (kw.get("num_stages"), kw.get("num_warps"), out["num_stages"], out["num_warps"])
        )
        return out

    monkeypatch.setattr(D, "plan", spy)
    poisoned, _ = make_inputs(11, b=1, t=1, kh=2, g=3, s=96, hd=64, dtype=jnp.float32, tree=False)
    R.rope_attention_splits(
        *copies(poisoned), num_heads=6, interpret=INTERPRET, tile=(32, 1, 32, 2)
    )
    R.rope_attention_splits(*copies(poisoned), num_heads=6, interpret=INTERPRET, tile=(32, 1, 32))
    assert seen == [(1, 2, 1, 2), (1, None, 1, 4)]


@pytest.mark.parametrize("t, dtype", [(1, jnp.float32), (5, jnp.bfloat16)])
def test_partial_sums_of_the_projections(t, dtype):
    """``qkv`` as float32 partial sums ``[P, B, T, heads, hd]`` (the split-K projection kernels'
    output): the kernel sums them as it loads, rounds to the cache's dtype, and matches the
    unfused path on their rounded sum. A kernel that read one partial only would be off by the
    others (each as large as the total)."""
    poisoned, clean = make_inputs(3, b=2, t=t, kh=2, g=3, s=70, hd=64, dtype=dtype, tree=False)
    rng = np.random.default_rng(5)
    qkv = np.asarray(clean[0], np.float32)
    parts = rng.normal(size=(3, *qkv.shape)).astype(np.float32)
    parts = np.concatenate([parts, (qkv - parts.sum(0))[None]])  # they sum to qkv
    parts = jnp.asarray(parts)
    got = R.rope_attention(parts, *copies(poisoned[1:]), num_heads=6, interpret=INTERPRET)
    check(got, R.reference(parts, *clean[1:], num_heads=6), poisoned, dtype)
    assert R.unsupported_reason(parts.astype(jnp.bfloat16), 6, clean[3], clean[7]) is not None


def test_new_tokens_past_the_capacity_are_neither_written_nor_seen():
    poisoned, clean = make_inputs(
        3, b=2, t=4, kh=2, g=2, s=40, hd=64, dtype=jnp.float32, tree=False, near_end=True
    )
    got = R.rope_attention(*copies(poisoned), num_heads=4, interpret=INTERPRET)
    check(got, R.reference(*clean, num_heads=4), poisoned, jnp.float32)


def test_only_appended_blocks():
    poisoned, _ = make_inputs(0, b=1, t=4, kh=2, g=2, s=40, hd=64, dtype=jnp.float32, tree=False)
    qkv, _, _, kc, _, _, _, mask = poisoned
    assert R.unsupported_reason(qkv, 4, kc, mask) is None
    wide = jnp.zeros(mask.shape[:2] + (8,), bool)  # a block window wider than the new tokens
    assert "not an appended block" in R.unsupported_reason(qkv, 4, kc, wide)
    assert "heads" in R.unsupported_reason(qkv, 6, kc, mask)
    with pytest.raises(ValueError, match="appended"):
        R.rope_attention(*copies(poisoned[:7]), wide, num_heads=4, interpret=True)


def test_query_rows_are_gathered_per_token_and_head():
    """Each query head must meet its own token's RoPE angle and its own KV head: a tree verify
    with a distinct angle per token, four query heads per KV head and three KV heads, where a
    row mix-up (token-major against head-major) changes the output."""
    poisoned, clean = make_inputs(5, b=2, t=6, kh=3, g=4, s=50, hd=64, dtype=jnp.float32, tree=True)
    got = R.rope_attention(*copies(poisoned), num_heads=12, interpret=INTERPRET)
    check(got, R.reference(*clean, num_heads=12), poisoned, jnp.float32)


FUSED = dict(fused_attention="interpret", gemm_rows=8)  # the GPU's padded residual stream
SHAPE = dict(num_heads=6, num_kv_heads=2, head_dim=64, hidden_size=96, vocab_size=64)


def retrace():
    """Forget compiled programs, so a spy on the kernel sees the next run's trace."""
    from jaxspec.engines import programs

    programs._COMPILED.clear()
    jax.clear_caches()


def test_model_tokens_with_the_fused_kernel(monkeypatch):
    """KernelConfig(fused_attention="interpret"), with the residual stream padded as on a GPU:
    autoregressive, chain, tree and MagicDec decoding (decode steps, chain and tree verifies and
    the sparse drafts' steps take the kernel) give the plain path's greedy tokens, float32."""
    from jaxspec.api import generate
    from jaxspec.kernels import KernelConfig
    from tests import tiny

    target = tiny.model(3, **SHAPE)
    ps = tiny.prompts(3, lengths=(19, 4, 11), vocab=64)
    runs = [
        dict(),
        # the chain's verify (4 rows) and its draft model's steps; the tree's verify of its
        # nodes under their tree mask
        dict(method="chain", draft=tiny.perturbed(target, 0.3, 3), gamma=3),
        dict(method="tree", draft="ngram", depth=3),
        # sparse drafts: the streaming ring's steps and SnapKV's selection over a fused prefill
        dict(method="magicdec", draft="self-streaming", gamma=2, budget=18, sinks=2),
        dict(method="magicdec", draft="self-snapkv", gamma=2, budget=24),
    ]
    # every method's greedy tokens are the plain autoregressive ones (lossless; their own tests
    # check each method on the plain path), so one plain run is the reference for all
    plain = generate(target, ps, max_new_tokens=12).tokens

    calls = []
    real = R.rope_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[1])  # T of the step
        return real(*args, **kwargs)

    monkeypatch.setattr(R, "rope_attention", counted)
    retrace()
    kernels = KernelConfig(**FUSED)
    fused = [generate(target, ps, max_new_tokens=12, kernels=kernels, **kw).tokens for kw in runs]
    assert fused == [plain] * len(runs)
    assert 1 in calls and max(calls) > 1  # decode steps and verifies took it


@pytest.mark.parametrize("padding", ["gemm", "stream"])
def test_model_logits_with_the_fused_kernel(monkeypatch, padding):
    """The tokens of tiny random models barely depend on attention, so the same steps are also
    compared by their float32 logits and caches: a prefill, a decode step, a 3-token verify.
    With the residual stream padded to 8 rows too (the GPU's setting), where the kernel takes
    the real rows of the padded projections."""
    from jaxspec.kernels import KernelConfig

    m = tiny_model(4, SHAPE)
    run = functools.partial(model_steps, m, rows=2)

    plain = run(KernelConfig(fused_attention="off"))
    calls = []
    real = R.rope_attention
    monkeypatch.setattr(R, "rope_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    retrace()
    fused = run(KernelConfig(**FUSED, row_padding=padding))
    assert calls, "the fused kernel took the decode and verify steps"
    for a, b in zip(fused, plain, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def model_steps(m, kernels, rows: int) -> list[np.ndarray]:
    """The float32 logits of a prefill of 8 random tokens, a decode step and a 3-token verify
    (the later rows one token fewer) over ``rows`` batch rows, then the caches they wrote."""
    import jaxspec.model.transformer as model_module
    from jaxspec.model.kv_cache import init_cache

    ids = jnp.asarray(np.random.default_rng(4).integers(0, 64, (rows, 8)), jnp.int32)
    steps = [(ids, 0, 8), (ids[:, :1], 8, 1), (ids[:, 2:5], 9, 3)]  # (tokens, length, valid)
    net = m.net(kernels)
    cache, out = init_cache(m.config, rows, 32, jnp.float32), []
    fwd = jax.jit(model_module.apply, static_argnums=0)
    for toks, at, n in steps:
        length = jnp.full((rows,), at, jnp.int32)
        cache.length = length
        valid = jnp.asarray([n] + [max(n - 1, 1)] * (rows - 1))
        block = causal_block(length, length, valid, toks.shape[1])
        logits, cache = fwd(net, m.flat, toks, cache, block)
        out.append(np.asarray(logits))
    return out + [np.asarray(x) for x in cache.k + cache.v]


def tiny_model(seed, changes):
    from tests import tiny

    return tiny.model(seed, **changes)


def test_dispatch_modes():
    """auto: the kernel on GPU only; never in programs traced for sharded weights, never for a
    block that is not appended; a bad setting is an error that names the choices."""
    import dataclasses

    from flax import nnx

    from jaxspec.errors import OptionError
    from jaxspec.kernels import KernelConfig

    m = tiny_model(0, SHAPE)
    att = nnx.merge(m.graphdef, m.params).layers[0].self_attn
    x = jnp.zeros((1, 1, 96), jnp.float32)
    cache = jnp.zeros((1, 16, 2, 64), jnp.float32)
    block = causal_block(
        jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), 1
    )
    on_gpu = jax.default_backend() == "gpu"
    auto = KernelConfig().resolve(m.config)
    assert att.fused_attention(x.dtype, cache, block, auto) == ("pallas" if on_gpu else None)
    assert m.net().kernels == auto  # a model without its own config runs the defaults
    on = KernelConfig(fused_attention="interpret").resolve(m.config)
    assert att.fused_attention(x.dtype, cache, block, on) == "interpret"
    sharded = KernelConfig(fused_attention="interpret").resolve(m.config, sharded=True)
    assert sharded.fused_attention == "off"
    assert att.fused_attention(x.dtype, cache, block, sharded) is None
    unappended = dataclasses.replace(block, appended=False)
    assert att.fused_attention(x.dtype, cache, unappended, on) is None
    assert att.fused_attention(jnp.bfloat16, cache, block, on) is None  # dtype mismatch
    with pytest.raises(OptionError, match="auto, off, pallas, interpret"):
        KernelConfig(fused_attention="fast")
    with pytest.raises(OptionError, match="JAXSPEC_FUSED_ATTENTION.*auto, off, pallas, interpret"):
        KernelConfig.from_env({"JAXSPEC_FUSED_ATTENTION": "fast"})
    if not on_gpu:
        with pytest.raises(OptionError, match="GPU"):
            KernelConfig(fused_attention="pallas").resolve(m.config)


def test_time_split_traces_sharded_weights_without_the_fused_kernel(monkeypatch):
    """The time split (and the cost model: the same units) times the program the run compiled:
    with the fused kernel for weights on one device, without it for weights split over two
    (the kernel has no partitioning rule)."""
    from jaxspec.api import generate
    from jaxspec.kernels import KernelConfig
    from jaxspec.measure import time_split
    from jaxspec.model import sharding

    m = tiny_model(0, SHAPE)
    prompt = [[1, 2, 3, 4, 5]]
    kernels = KernelConfig(fused_attention="interpret")
    calls = []
    real = R.rope_attention
    monkeypatch.setattr(R, "rope_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    r = generate(m, prompt, max_new_tokens=4, kernels=kernels)
    assert r.call.prog.net.kernels.fused_attention == "interpret" and calls
    calls.clear()
    retrace()
    time_split.measure(r.call, reps=1)
    assert calls, "one device: the fused kernel is traced"
    calls.clear()
    placed, _ = sharding.place(m, jax.devices()[:2])
    assert placed.weights.sharded and not m.weights.sharded
    r = generate(placed, prompt, max_new_tokens=4, kernels=kernels)
    assert r.call.prog.net.kernels.fused_attention == "off"
    retrace()
    time_split.measure(r.call, reps=1)
    assert not calls
    retrace()
