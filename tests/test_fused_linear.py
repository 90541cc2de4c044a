"""The split-K projection kernels (pallas_kernels/fused_linear.py) against their pure-jnp
references on fresh random inputs, and a model decoding through them against the plain path.

On CPU the kernels run through the Pallas interpreter, whose outputs start as NaN: an element a
kernel forgets to write shows up. Sizes are odd on purpose and tiles small (``bn``, ``bk``), so
every case has several column tiles and K splits, and tiles that hang past the arrays' ends."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.errors import OptionError
from jaxspec.kernels import KernelConfig
from pallas_kernels import fused_linear as fl
from pallas_kernels import rope_attention
from tests import tiny
from tests.test_rope_attention import model_steps

INTERPRET = jax.default_backend() != "gpu"
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def _arr(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    assert not np.isnan(got).any(), "an output element was never written"
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * scale)


CASES = [  # (rows, K, widths of the weights side by side, MLP width, bn, bk)
    (1, 80, (48, 40), 48, 16, 32),
    (3, 96, (64, 16), 40, 32, 16),
    (16, 50, (30, 20, 20), 24, 16, 16),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m, k, widths, f, bn, bk", CASES)
def test_kernels_match_references(m, k, widths, f, bn, bk, dtype):
    rng = np.random.default_rng(m * 1000 + k)
    tile = dict(interpret=INTERPRET, bn=bn, bk=bk)
    x, g = _arr(rng, (m, k), dtype), _arr(rng, (k,), dtype)
    ws = tuple(_arr(rng, (k, n), dtype, 0.2) for n in widths)
    for pending in (None, _arr(rng, (3, m, k), jnp.float32)):
        settled, part = fl.norm_project(x, pending, g, ws, eps=1e-5, **tile)
        want_x, want = fl.norm_project_reference(x, pending, g, ws, eps=1e-5)
        assert part.shape == (fl.n_splits(k, bk), m, sum(widths)) and part.dtype == jnp.float32
        assert not np.isnan(np.asarray(part)).any(), "a partial was never written"
        # the residual add is the reference's to the bit (same operations, same order)
        np.testing.assert_array_equal(np.asarray(settled), np.asarray(want_x))
        _close(jnp.sum(part, axis=0), jnp.concatenate(want, axis=1), dtype)
    a = _arr(rng, (m, k), dtype)
    _close(
        jnp.sum(fl.project(a, ws, **tile), axis=0),
        jnp.concatenate([fl._mm(a, w) for w in ws], 1),
        dtype,
    )
    gate_up, wd = _arr(rng, (4, m, 2 * f), jnp.float32), _arr(rng, (f, k), dtype, 0.2)
    got = fl.silu_project(gate_up, wd, **tile)
    assert got.shape == (fl.n_splits(f, bk), m, k)
    _close(jnp.sum(got, axis=0), fl.silu_project_reference(gate_up, wd, dtype), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "b, t, kh, g, splits, hd, bn, bk",
    [
        (1, 1, 3, 3, 4, 64, 64, 128),  # SmolLM2's decode step: two heads a K split
        (2, 3, 2, 3, 5, 32, 16, 16),  # half a head a K split, batch and tokens interleaved
        (1, 5, 2, 2, 3, 64, 32, 128),  # a chain verify's 5 tokens
    ],
)
def test_combine_project_merges_the_attention_splits(b, t, kh, g, splits, hd, bn, bk, dtype):
    """o_proj over the attention kernel's unmerged splits equals the combine, then o_proj.
    Split 0 is empty everywhere (as a split past a row's length is) and one row sees nothing,
    so its output is zeros."""
    rng = np.random.default_rng(b * 100 + t)
    mp = max(16, 1 << (t * g - 1).bit_length())
    acc = rng.normal(size=(b, kh, splits, mp, hd)).astype(np.float32)
    m = (3 * rng.normal(size=(b, kh, splits, mp))).astype(np.float32)
    ssum = rng.uniform(0.5, 2.0, size=(b, kh, splits, mp)).astype(np.float32)
    for sel in ((slice(None), slice(None), 0), (0, 0, slice(None), 0)):
        acc[sel], m[sel], ssum[sel] = 0.0, -1e30, 0.0
    acc, m, ssum = jnp.asarray(acc), jnp.asarray(m), jnp.asarray(ssum)
    w = _arr(rng, (kh * g * hd, 40), dtype, 0.2)
    got = fl.combine_project(acc, m, ssum, w, t=t, interpret=INTERPRET, bn=bn, bk=bk)
    assert got.shape == (fl.n_splits(kh * g * hd, bk), b * t, 40)
    want = fl.combine_project_reference(acc, m, ssum, w, t=t)
    _close(jnp.sum(got, axis=0), want, dtype)


def test_silu_takes_gate_and_up_from_their_halves():
    """A negative control for the gate / up pairing: swapping the halves changes the result
    (SiLU is not symmetric), and the kernel follows the reference either way."""
    rng = np.random.default_rng(7)
    gate_up, wd = _arr(rng, (2, 1, 32), jnp.float32), _arr(rng, (16, 8), jnp.float32)
    swapped = jnp.concatenate([gate_up[..., 16:], gate_up[..., :16]], axis=-1)
    tile = dict(interpret=INTERPRET, bn=16, bk=16)
    a = jnp.sum(fl.silu_project(gate_up, wd, **tile), axis=0)
    b = jnp.sum(fl.silu_project(swapped, wd, **tile), axis=0)
    assert not np.allclose(a, b, atol=1e-3)
    _close(b, fl.silu_project_reference(swapped, wd, jnp.float32), jnp.float32)


def test_unsupported_shapes():
    x = jnp.zeros((fl.MAX_ROWS + 1, 16))
    assert "rows" in fl.unsupported_reason(x, jnp.zeros((16, 16)))
    x = jnp.zeros((2, 16))
    assert "dtypes" in fl.unsupported_reason(x, jnp.zeros((16, 16), jnp.bfloat16))
    assert "does not take" in fl.unsupported_reason(x, jnp.zeros((8, 16)))
    assert fl.unsupported_reason(x, jnp.zeros((16, 24))) is None  # any width: tiles are masked
    assert fl.n_splits(576, 64) == 9 and fl.n_splits(1536, 64) == 24 and fl.n_splits(50, 16) == 4
    for bad in (dict(bn=48), dict(bk=8)):  # the kernels' own check of their static tiles
        with pytest.raises(ValueError, match="powers of two"):
            fl.project(x, (jnp.zeros((16, 16)),), interpret=True, **bad)
    # the config's check, before anything is traced (and the variables that set it)
    for bad in ((48, 128, 4), (64, 8, 4), (64, 128, 0)):
        with pytest.raises(OptionError, match="linear_tile"):
            KernelConfig(linear_tile=bad)
    with pytest.raises(OptionError, match="JAXSPEC_FUSED"):
        KernelConfig.from_env({"JAXSPEC_FUSED_BN": "48"})
    assert KernelConfig.from_env({"JAXSPEC_FUSED_BK": "64"}).linear_tile == (64, 64, 4, 256)
    # SmolLM2-135M's layer takes them; Llama-3.2-1B's would re-read 512 KiB of partials a program
    assert fl.layer_problem(576, 576, 1536, bk=128) is None
    assert "524288 bytes of down" in fl.layer_problem(2048, 2048, 8192, bk=128)


SHAPE = dict(hidden_size=64, head_dim=64, intermediate_size=96)  # shapes the kernels take


def test_the_model_keeps_big_layers_on_the_plain_path():
    """The config resolves the split-K kernels off for layers whose norm programs would re-read
    more than ``MAX_PENDING_BYTES`` of partials (by the tile's BK), and for biased
    projections; the model then takes the plain path."""
    import dataclasses

    on = KernelConfig(fused_linear="interpret", linear_tile=(64, 128, 4))
    # 512-wide rows: down's partials are 512 x 4 bytes each, ceil(intermediate / 128) of them
    parts = fl.MAX_PENDING_BYTES // (512 * 4)
    cfg = dataclasses.replace(
        tiny.CFG, hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64,
        intermediate_size=parts * 128,
    )  # fmt: skip
    assert on.resolve(cfg).fused_linear == "interpret"  # exactly MAX_PENDING_BYTES
    bigger = dataclasses.replace(cfg, intermediate_size=parts * 128 + 1)
    assert on.resolve(bigger).fused_linear == "off"  # one partial more
    finer = dataclasses.replace(on, linear_tile=(64, 64, 4))  # BK 64: twice the partials
    assert finer.resolve(cfg).fused_linear == "off"
    assert on.resolve(dataclasses.replace(cfg, qkv_bias=True)).fused_linear == "off"
    llama_1b = dataclasses.replace(
        cfg, hidden_size=2048, num_heads=32, head_dim=64, intermediate_size=8192
    )
    assert on.resolve(llama_1b).fused_linear == "off"
    # the model follows its resolved config: a biased model of kernel-sized shapes stays plain
    x = jnp.zeros((1, 1, 64))
    for bias, want in ((False, "interpret"), (True, None)):
        small = tiny.model(0, **SHAPE, qkv_bias=bias)
        layer = nnx.merge(small.graphdef, small.params).layers[0]
        assert layer.fused_mode(x, small.net(on).kernels) == want


def test_dispatch():
    m = tiny.model(0, **SHAPE)
    layer = nnx.merge(m.graphdef, m.params).layers[0]
    rows = jnp.zeros((1, 64))
    on_gpu = jax.default_backend() == "gpu"
    auto = KernelConfig().resolve(m.config)
    assert layer.fused_mode(rows, auto) == ("pallas" if on_gpu else None)  # auto: GPU only
    on = KernelConfig(fused_linear="interpret").resolve(m.config)
    assert on.linear_tile == (64, 128, 4, 256)  # the measured tiling unless one is given
    assert layer.fused_mode(rows, on) == "interpret"
    assert layer.fused_mode(jnp.zeros((fl.MAX_ROWS + 1, 64)), on) is None  # prefill-sized
    sharded = KernelConfig(fused_linear="interpret").resolve(m.config, sharded=True)
    assert layer.fused_mode(rows, sharded) is None
    with pytest.raises(OptionError, match="fused_linear must be one of"):
        KernelConfig(fused_linear="fast")
    with pytest.raises(OptionError, match="JAXSPEC_FUSED_LINEAR must be one of"):
        KernelConfig.from_env({"JAXSPEC_FUSED_LINEAR": "fast"})
    if not on_gpu:
        with pytest.raises(OptionError, match="needs a GPU"):
            KernelConfig(fused_linear="pallas").resolve(m.config)


def test_qkv_takes_its_own_k_split(monkeypatch):
    """``linear_tile``'s fourth entry is the Q/K/V projection's BK: with (16, 16, 4, 32) the
    fused attention kernel gets 2 Q/K/V partials (64 / 32) while the other projections keep 4
    (64 / 16), and a prefill, a decode step and a 3-token verify give the plain path's float32
    logits and caches. The entry is checked and read from ``JAXSPEC_FUSED_QKV_BK``."""
    for bad in ((16, 16, 4, 24), (16, 16, 4, 8), (16, 16, 4, 32, 1)):
        with pytest.raises(OptionError, match="linear_tile"):
            KernelConfig(linear_tile=bad)
    assert KernelConfig(linear_tile=(16, 16, 4, None)).linear_tile == (16, 16, 4, None)
    env = KernelConfig.from_env({"JAXSPEC_FUSED_QKV_BK": "256"})
    assert env.linear_tile == (64, 128, 4, 256)
    assert KernelConfig.from_env({"JAXSPEC_FUSED_BN": "32"}).linear_tile == (32, 128, 4, 256)
    with pytest.raises(OptionError, match="JAXSPEC_FUSED"):
        KernelConfig.from_env({"JAXSPEC_FUSED_QKV_BK": "100"})

    m = tiny.model(4, **SHAPE, vocab_size=64)
    run = functools.partial(model_steps, m, rows=1)

    plain = run(KernelConfig(fused_linear="off", fused_attention="off"))
    parts, pending = [], []
    real_attention, real_silu = rope_attention.rope_attention_splits, fl.silu_project
    monkeypatch.setattr(
        rope_attention,
        "rope_attention_splits",
        lambda qkv, *a, **k: parts.append(qkv.shape[0]) or real_attention(qkv, *a, **k),
    )
    monkeypatch.setattr(
        fl, "silu_project", lambda g, *a, **k: pending.append(g.shape[0]) or real_silu(g, *a, **k)
    )
    _clear()
    mode = "interpret" if INTERPRET else "pallas"  # on a GPU: the compiled kernels
    kernels = KernelConfig(
        fused_linear=mode, fused_attention=mode, linear_tile=(16, 16, 4, 32), linear_rows=16
    )
    fused = run(kernels)
    _clear()
    assert set(parts) == {2} and set(pending) == {4}, (parts, pending)
    for a, b in zip(fused, plain, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


def _clear():
    """Forget compiled programs, so the spies below see the next run's traces."""
    from jaxspec.engines import programs

    programs._COMPILED.clear()
    jax.clear_caches()


def _case(seed):
    # shapes the kernels take (the default tiny model's head_dim 8 is too small for them)
    target = tiny.model(seed, **SHAPE)
    return target, tiny.perturbed(target, 0.3, seed), tiny.prompts(seed, lengths=(9, 3))


def _runs(seed, kernels, tree):
    """Greedy tokens of autoregressive decoding (one row), a chain over a ragged batch of two
    (its tokens and acceptance) and, with ``tree``, a tree (one row: the target verifies an
    appended block of 5 rows; the draft expands its tree in a block window, plain attention
    then ``project``)."""
    target, draft, prompts = _case(seed)
    ar = jaxspec.generate(target, prompts[:1], max_new_tokens=12, kernels=kernels)
    chain = jaxspec.generate(
        target, prompts, max_new_tokens=12, method="chain", draft=draft, gamma=3, kernels=kernels
    )
    tokens = tree and jaxspec.generate(
        target, prompts[:1], max_new_tokens=8, method="tree", draft=draft,
        depth=2, width=2, branch=2, bs=4, kernels=kernels,
    ).tokens  # fmt: skip
    return ar.tokens, chain.tokens, chain.stats["acceptance_length"], tokens


@functools.cache
def _plain_runs(seed):
    """The reference: ``_runs`` with both kernels off, once per seed and process (the cases of
    one seed share it)."""
    return _runs(seed, KernelConfig(fused_linear="off", fused_attention="off"), tree=seed == 2)


@pytest.mark.parametrize(
    "seed, attention",
    [
        (2, "off"),
        # the same runs as seed 2's with the fused attention kernel, less its tree: slow
        pytest.param(1, "interpret", marks=pytest.mark.slow),
        (2, "interpret"),
    ],
)
def test_decoding_through_the_kernels_equals_the_plain_path(seed, attention, monkeypatch):
    """Greedy tokens (float32) of autoregressive and chain decoding with every decode / verify
    step through the split-K kernels equal the plain path's (both kernels off); prefill chunks
    (more rows) take the plain path either way. With the fused attention kernel on, it sums the
    Q/K/V partials, and a tree runs too; with it off, the model sums them before RoPE.
    Autoregressive decodes one row (one-row steps: the norms and the merge of the attention's
    splits inside the projection kernels); the chain a ragged batch of two (its 8-row verify and
    2-row draft steps: the norms and the merge once, beside the projections)."""
    traced = []
    real = fl.silu_project
    monkeypatch.setattr(fl, "silu_project", lambda *a, **k: traced.append(1) or real(*a, **k))
    ranks, merged = [], []  # ranks of the Q/K/V the fused attention kernel got; o_proj merges
    bounds = set()  # the split bounds asked for where o_proj merges the splits (5-D Q/K/V)
    real_attention, real_merge = rope_attention.rope_attention_splits, fl.combine_project

    def record(qkv, *a, **k):
        ranks.append(qkv.ndim)
        if qkv.ndim == 5:
            bounds.add((k.get("min_split"), k.get("max_splits")))
        return real_attention(qkv, *a, **k)

    monkeypatch.setattr(rope_attention, "rope_attention_splits", record)
    monkeypatch.setattr(
        fl, "combine_project", lambda *a, **k: merged.append(1) or real_merge(*a, **k)
    )
    wide = []  # row counts of the projections of several rows
    real_project = fl.project
    monkeypatch.setattr(
        fl,
        "project",
        lambda a, *r, **k: (a.shape[0] > 1 and wide.append(a.shape[0])) or real_project(a, *r, **k),
    )
    _clear()
    want = _plain_runs(seed)
    assert not traced and not wide and not ranks, "the plain path traced a kernel"
    # 16 x 16 tiles: several column tiles and K splits in every projection; the fused attention
    # kernel 'interpret': the Q/K/V partials go into it. linear_rows 16 on every backend: the
    # GPU's default (1) would send these two-row steps to the plain path
    kernels = KernelConfig(
        fused_linear="interpret", linear_tile=(16, 16, 4), linear_rows=16, fused_attention=attention
    )
    _clear()
    got = _runs(seed, kernels, tree=seed == 2 and attention == "interpret")
    _clear()
    assert {2, 8} <= set(wide), wide  # the chain's draft steps and verify
    assert traced, "the fused kernels were never traced: the test compared the plain path twice"
    # with the fused attention kernel on, it took the projections as partials (5-D) and o_proj
    # merged its splits
    assert (5 in ranks) == bool(merged) == (attention == "interpret")
    # where o_proj merges the splits (one row) it asks for its split length and bound
    # (fl.COMBINE_BOUNDS); blocks of more rows take the kernel's own plan, merged in XLA
    want_bounds = (fl.COMBINE_MIN_SPLIT, fl.COMBINE_SPLITS)
    assert bounds == ({want_bounds, (None, None)} if attention == "interpret" else set())
    assert got[0] == want[0]
    assert got[1] == want[1]
    assert want[1][:1] == want[0]
    assert got[2] == want[2]
    if got[3]:
        assert got[3][0] == want[0][0][:8]
        assert got[3] == want[3]


@pytest.mark.skipif(
    len(jax.devices()) < 2, reason="needs two devices (the CPU suite forces 8; a one-GPU run has 1)"
)
def test_sharded_weights_trace_without_the_kernels(monkeypatch):
    """A program over weights sharded on several devices (tensor parallel) resolves the split-K
    kernels off (a kernel would see whole weights, so they would be gathered): the run traces
    none of them and gives the single-device tokens."""
    from jaxspec.model import sharding

    m = tiny.model(0, **SHAPE, vocab_size=64)  # every split dimension even
    placed, _ = sharding.place(m, jax.devices()[:2])
    kernels = KernelConfig(fused_linear="interpret")
    assert m.net(kernels).kernels.fused_linear == "interpret"
    assert placed.net(kernels).kernels.fused_linear == "off"
    assert m.net(kernels, sharded=True).kernels.fused_linear == "off"
    traced = []
    real = fl.silu_project
    monkeypatch.setattr(fl, "silu_project", lambda *a, **k: traced.append(1) or real(*a, **k))
    ps = tiny.prompts(0, lengths=(5, 3), vocab=64)
    _clear()
    one = jaxspec.generate(m, ps, max_new_tokens=4, kernels=kernels)
    assert traced, "one device: the kernels are traced"
    traced.clear()
    _clear()
    split = jaxspec.generate(placed, ps, max_new_tokens=4, kernels=kernels)
    assert not traced
    assert split.tokens == one.tokens
    _clear()
