"""The fused projection kernels (pallas_kernels/fused_linear.py) against their pure-jnp
references on fresh random inputs, and a model decoding through them against the plain path.

On CPU the kernels run through the Pallas interpreter, whose outputs start as NaN: an element a
kernel forgets to write shows up. Row counts and widths are odd on purpose (K = 80 = 64 + 16
exercises the power-of-two chunking, M = 3 / 5 / 16 the per-row loops)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
import jaxspec.model as jm
from pallas_kernels import fused_linear as fl
from tests import tiny

INTERPRET = jax.default_backend() != "gpu"
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def _arr(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _rope_tables(rng, m, hd):
    pos = rng.integers(0, 4000, m)
    inv = 1.0 / (10000.0 ** (np.arange(hd // 2) * 2 / hd))
    ang = pos[:, None] * inv
    return jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any(), "an output element was never written"
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * scale)


CASES = [  # (rows, K, head_dim, q heads, kv heads, MLP width)
    (1, 80, 32, 3, 1, 48),
    (3, 96, 32, 4, 2, 32),
    (5, 64, 64, 2, 2, 48),
    (16, 48, 32, 6, 3, 64),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m, k, hd, nq, nk, f", CASES)
def test_kernels_match_references(m, k, hd, nq, nk, f, dtype):
    rng = np.random.default_rng(m * 1000 + k)
    x, g = _arr(rng, (m, k), dtype), _arr(rng, (k,), dtype)
    wq, wk, wv = (_arr(rng, (k, n * hd), dtype, 0.2) for n in (nq, nk, nk))
    cos, sin = _rope_tables(rng, m, hd)
    got = fl.qkv_rope(x, g, wq, wk, wv, cos, sin, eps=1e-5, head_dim=hd, interpret=INTERPRET)
    want = fl.qkv_rope_reference(x, g, wq, wk, wv, cos, sin, eps=1e-5, head_dim=hd)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == dtype
        _close(a, b, dtype)
    wg, wu = _arr(rng, (k, f), dtype, 0.2), _arr(rng, (k, f), dtype, 0.2)
    _close(
        fl.gate_up(x, g, wg, wu, eps=1e-5, interpret=INTERPRET),
        fl.gate_up_reference(x, g, wg, wu, eps=1e-5),
        dtype,
    )
    h, wd = _arr(rng, (m, f), dtype), _arr(rng, (f, k), dtype, 0.2)
    _close(fl.matmul_add(h, wd, x, interpret=INTERPRET), fl.matmul_add_reference(h, wd, x), dtype)


def test_rope_is_applied_to_q_and_k_only():
    """A negative control for the RoPE pairing: at position 0 RoPE is the identity, elsewhere q and
    k change and v never does."""
    rng = np.random.default_rng(7)
    m, k, hd = 2, 32, 32
    x, g = _arr(rng, (m, k), jnp.float32), _arr(rng, (k,), jnp.float32)
    wq, wk, wv = (_arr(rng, (k, 2 * hd), jnp.float32) for _ in range(3))
    zero = jnp.zeros((m, hd // 2), jnp.float32)
    plain = fl.qkv_rope(
        x, g, wq, wk, wv, zero + 1, zero, eps=1e-5, head_dim=hd, interpret=INTERPRET
    )
    cos, sin = _rope_tables(rng, m, hd)
    rot = fl.qkv_rope(x, g, wq, wk, wv, cos, sin, eps=1e-5, head_dim=hd, interpret=INTERPRET)
    n = fl.rms(x, g, 1e-5)
    for got, w in zip(plain, (wq, wk, wv), strict=True):
        _close(got, n @ w, jnp.float32)
    assert not np.allclose(rot[0], plain[0]) and not np.allclose(rot[1], plain[1])
    _close(rot[2], plain[2], jnp.float32)


def test_unsupported_shapes():
    x = jnp.zeros((fl.MAX_ROWS + 1, 16))
    assert "rows" in fl.unsupported_reason(x, jnp.zeros((16, 16)))
    x = jnp.zeros((2, 16))
    assert "dtypes" in fl.unsupported_reason(x, jnp.zeros((16, 16), jnp.bfloat16))
    assert "does not take" in fl.unsupported_reason(x, jnp.zeros((8, 16)))
    assert "width 24" in fl.unsupported_reason(x, jnp.zeros((16, 24)))
    assert "row width" in fl.unsupported_reason(jnp.zeros((2, 24)), jnp.zeros((24, 16)))
    assert "head_dim" in fl.unsupported_reason(x, jnp.zeros((16, 16)), head_dim=16)
    assert fl.unsupported_reason(x, jnp.zeros((16, 16)), head_dim=64) is None
    assert fl._chunks(576) == [(0, 512), (512, 64)]
    assert fl._chunks(2560) == [(0, 1024), (1024, 1024), (2048, 512)]
    assert fl._chunks(80) == [(0, 64), (64, 16)]


def test_dispatch(monkeypatch):
    rows, w = jnp.zeros((1, 16)), jnp.zeros((16, 16))
    assert jm.fused_mode(rows, w) is None  # off by default: slower than XLA on the H200
    monkeypatch.setattr(jm, "FUSED_IMPL", "auto")
    assert jm.fused_mode(rows, w) == ("pallas" if jax.default_backend() == "gpu" else None)
    monkeypatch.setattr(jm, "FUSED_IMPL", "interpret")
    assert jm.fused_mode(rows, w) == "interpret"
    assert jm.fused_mode(jnp.zeros((fl.MAX_ROWS + 1, 16)), w) is None
    with jm.fused_kernels_off():
        assert jm.fused_mode(rows, w) is None
    assert jm.fused_mode(rows, w) == "interpret"
    monkeypatch.setattr(jm, "FUSED_IMPL", "fast")
    with pytest.raises(ValueError, match="JAXSPEC_FUSED_LINEAR must be one of"):
        jm.fused_mode(rows, w)
    if jax.default_backend() != "gpu":
        monkeypatch.setattr(jm, "FUSED_IMPL", "pallas")
        with pytest.raises(ValueError, match="needs a GPU"):
            jm.fused_mode(rows, w)


def _clear():
    from jaxspec.engines import common

    common._COMPILED.clear()
    jax.clear_caches()


@pytest.mark.parametrize("seed", range(3))
def test_decoding_through_the_kernels_equals_the_plain_path(seed, monkeypatch):
    """Greedy tokens (float32) of autoregressive and chain decoding with every decode / verify
    step through the fused kernels equal the plain path's; prefill chunks (more rows) take the
    plain path either way."""
    # shapes the kernels take (the default tiny model's head_dim 8 is too small for them)
    target = tiny.model(seed, hidden_size=64, head_dim=32, intermediate_size=96)
    draft = tiny.perturbed(target, 0.3, seed)
    prompts = tiny.prompts(seed, lengths=(9, 3))
    traced = []
    real_gate_up = fl.gate_up
    monkeypatch.setattr(fl, "gate_up", lambda *a, **k: traced.append(1) or real_gate_up(*a, **k))
    runs = {}
    for impl in ("off", "interpret"):
        monkeypatch.setattr(jm, "FUSED_IMPL", impl)
        _clear()
        ar = jaxspec.generate(target, prompts, max_new_tokens=12)
        chain = jaxspec.generate(
            target, prompts, max_new_tokens=12, method="chain", draft=draft, gamma=3
        )
        runs[impl] = (ar.tokens, chain.tokens, chain.stats["acceptance_length"])
        assert bool(traced) == (impl == "interpret")
    _clear()
    assert traced, "the fused kernels were never traced: the test compared the plain path twice"
    assert runs["interpret"][0] == runs["off"][0]
    assert runs["interpret"][1] == runs["off"][0]
    assert runs["interpret"][2] == runs["off"][2]


def test_sharded_compiles_trace_without_the_kernels(monkeypatch):
    """``compiled()`` traces with the kernels off when any argument is sharded over several
    devices (tensor parallel: a kernel would see whole weights, so they would be gathered)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxspec.engines import common

    monkeypatch.setattr(jm, "FUSED_IMPL", "interpret")
    seen = []

    @jax.jit
    def probe(w):
        seen.append(jm.fused_mode(jnp.zeros((1, 16)), jnp.zeros((16, 16))))
        return w * 2

    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    sharded = jax.device_put(jnp.ones((16, 16)), NamedSharding(mesh, PartitionSpec(None, "tp")))
    common.compiled(probe, jnp.ones((16, 16)))
    common.compiled(probe, sharded)
    assert seen == ["interpret", None]
