"""The flash kernel for wide blocks (prefill chunks) against the pure-jnp reference, its dispatch,
and a model's prefill through it (the Pallas interpreter on CPU, the compiled kernel on a GPU).

Unused cache slots hold NaN (``test_kernels.make_inputs``): the kernel must never read them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import kernels as K
from jaxspec.errors import OptionError
from jaxspec.kernels import KernelConfig
from jaxspec.model.kv_cache import init_cache
from jaxspec.model.prefill import fit_chunk, pad_prompts, prefill
from pallas_kernels import decode_attention as D
from pallas_kernels import dispatch
from pallas_kernels import prefill_attention as P
from tests import tiny
from tests.test_kernels import INTERPRET, check, make_inputs


def causal_masks(b: int, t: int, n: int, valid) -> np.ndarray:
    """``causal_block``'s mask: token i < valid[b] sees block slots j <= i."""
    i = np.arange(t)[:, None]
    j = np.arange(n)[None, :]
    return np.stack([(j <= i) & (i < v) & (j < v) for v in valid])


def with_mask(args, mask):
    q, k, v, length, _ = args
    return q, k, v, length, jnp.asarray(mask)


CASES = [
    # (T, G, S, N, lengths, dtype, block_q, block_k)
    pytest.param(100, 3, 300, 100, [0, 150, 37], jnp.float32, 32, 16, id="t100-gqa3-f32"),
    pytest.param(80, 1, 200, 96, [120, 0], jnp.bfloat16, None, None, id="t80-n96-bf16"),
    pytest.param(70, 2, 160, 70, [89, 3], jnp.float16, 16, 32, id="t70-gqa2-f16"),
    pytest.param(5, 2, 64, 5, [59, 0], jnp.float32, 16, 16, id="t5-cache-end-f32"),
]


@pytest.mark.parametrize("t, g, s, n, lengths, dtype, bq, bk", CASES)
@pytest.mark.parametrize("masks", ["tree", "causal", "random"])
def test_matches_reference(t, g, s, n, lengths, dtype, bq, bk, masks):
    """Ancestor-closed tree masks, prefill-chunk (causal, ragged) masks and arbitrary masks (so
    skipping a tile is never decided by the shape of the mask alone); odd prefix lengths, a
    block ending at the cache's end, query and KV tiles that do not divide T or N."""
    poisoned, clean = make_inputs(
        t * 7 + g, b=len(lengths), t=t, kh=2, g=g, s=s, n=n, lengths=lengths, dtype=dtype
    )
    rng = np.random.default_rng(t + n)
    if masks == "causal":
        valid = [min(t, n)] + [int(x) for x in rng.integers(1, min(t, n) + 1, len(lengths) - 1)]
        mask = causal_masks(len(lengths), t, n, valid)
    elif masks == "random":
        mask = rng.random((len(lengths), t, n)) < 0.3
    if masks != "tree":
        poisoned, clean = with_mask(poisoned, mask), with_mask(clean, mask)
    got = P.prefill_attention(*poisoned, block_q=bq, block_k=bk, interpret=INTERPRET)
    assert got.shape == poisoned[0].shape and got.dtype == dtype
    check(got, clean, dtype)


def test_queries_that_see_nothing_are_zero():
    poisoned, _ = make_inputs(
        11, b=2, t=70, kh=1, g=2, s=96, n=70, lengths=[0, 0], dtype=jnp.float32
    )
    mask = causal_masks(2, 70, 70, [70, 9])
    got = P.prefill_attention(*with_mask(poisoned, mask), block_q=16, interpret=INTERPRET)
    assert (np.asarray(got[1, 9:]) == 0).all()
    assert np.isfinite(np.asarray(got)).all() and (np.abs(np.asarray(got[1, :9])) > 0).any()


def test_unsupported_and_bad_tiles():
    q = jnp.zeros((1, 80, 4, 96))
    k = jnp.zeros((1, 100, 2, 96))
    bm = jnp.ones((1, 80, 80), bool)
    assert "head_dim" in P.unsupported_reason(q, k, k, bm)
    q, k = jnp.zeros((1, 80, 4, 64)), jnp.zeros((1, 100, 2, 64))
    assert P.unsupported_reason(q, k, k, bm) is None
    assert "dtypes" in P.unsupported_reason(q, k.astype(jnp.bfloat16), k, bm)
    length = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="block_q=24"):
        P.prefill_attention(q, k, k, length, bm, block_q=24, interpret=True)
    with pytest.raises(ValueError, match="head_dim"):
        k96 = jnp.zeros((1, 100, 2, 96))
        P.prefill_attention(jnp.zeros((1, 80, 4, 96)), k96, k96, length, bm, interpret=True)


def test_dispatch_sends_wide_blocks_to_the_flash_kernel(monkeypatch):
    """T > 64 (or N > 128) takes the flash kernel, small blocks the split-K decode kernel; on a
    GPU 'auto' picks the kernels for both, elsewhere the reference."""
    calls = []
    for mod, name in ((P, "prefill_attention"), (D, "decode_attention")):
        fn = getattr(mod, name)
        monkeypatch.setattr(
            mod, name, lambda *a, _f=fn, _n=name, **k: calls.append(_n) or _f(*a, **k)
        )
    wide, wide_clean = make_inputs(
        3, b=2, t=72, kh=2, g=2, s=150, n=72, lengths=[60, 1], dtype=jnp.float32
    )
    small, small_clean = make_inputs(
        4, b=2, t=8, kh=2, g=2, s=80, n=8, lengths=[70, 3], dtype=jnp.float32
    )
    check(dispatch.attention(*wide, impl="pallas_interpret"), wide_clean, jnp.float32)
    check(dispatch.attention(*small, impl="pallas_interpret"), small_clean, jnp.float32)
    assert calls == ["prefill_attention", "decode_attention"]
    q, k, v, _, bm = wide
    want = "pallas" if jax.default_backend() == "gpu" else "reference"
    assert dispatch.choose_impl(q, k, v, bm) == want


def test_prefill_chunk_setting():
    chunk64 = KernelConfig(prefill_chunk=64).resolve(tiny.CFG)
    ids, _ = pad_prompts([[1] * 70, [2] * 3], chunk64)
    assert chunk64.prefill_tokens(2) == 64 and ids.shape[1] == 128
    ids, _ = pad_prompts([[1] * 40], chunk64)
    assert ids.shape[1] == 48
    for bad in (0, 40):
        with pytest.raises(OptionError, match="multiple of 16"):
            KernelConfig(prefill_chunk=bad)
    # JAXSPEC_PREFILL_CHUNK (the CLI's): a bad value names the variable
    assert KernelConfig.from_env({"JAXSPEC_PREFILL_CHUNK": "64"}).prefill_chunk == 64
    for bad, why in (("0", "multiple of 16"), ("40", "multiple of 16"), ("x", "integer")):
        with pytest.raises(OptionError, match=why) as e:
            KernelConfig.from_env({"JAXSPEC_PREFILL_CHUNK": bad})
        assert "JAXSPEC" in str(e.value)
    assert KernelConfig().resolve(tiny.CFG, backend="cpu").prefill_tokens(1) == 256
    target = tiny.model(1)
    # a width the chunk does not divide: the step is cut to one that does (48 = 3 x 16), and
    # every prompt token is still fed (the same logits as one step over the whole prompt)
    assert fit_chunk(48, 32) == 16 and fit_chunk(48, 64) == 48
    assert fit_chunk(40, 32) == 20 and fit_chunk(2048, 2048) == 2048
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 67, (1, 48)), jnp.int32)

    def first(chunk):
        c = init_cache(target.config, 1, 48)
        net = target.net(KernelConfig(prefill_chunk=chunk))
        return prefill(net, target.flat, c, ids, jnp.asarray([40], jnp.int32))[0]

    np.testing.assert_allclose(first(32), first(48), atol=1e-5)


def test_gpu_chunk_keeps_tokens_per_step_bounded():
    """On a GPU: up to 8192 tokens a row with cuDNN for the first chunk (2048 without), at most
    GPU_PREFILL_TOKENS a step, 256 at least."""
    gpu = KernelConfig().resolve(tiny.CFG, backend="gpu")
    got = [gpu.prefill_tokens(b) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert got == [8192, 8192, 4096, 2048, 1024, 512, 256, 256]
    flash = KernelConfig(prefill_attention="off").resolve(tiny.CFG, backend="gpu")
    assert [flash.prefill_tokens(b) for b in (1, 8, 16)] == [2048, 2048, 1024]
    # a float32 model cannot take cuDNN: its chunks are the flash kernel's
    assert gpu.prefill_tokens(1, jnp.float32) == 2048
    assert gpu.prefill_tokens(1, jnp.bfloat16) == 8192
    assert max(b * gpu.prefill_tokens(b) for b in (16, 32, 64)) == K.GPU_PREFILL_TOKENS
    assert KernelConfig(prefill_chunk=512).resolve(tiny.CFG, backend="gpu").prefill_tokens(1) == 512


def test_model_prefill_through_the_kernel(monkeypatch):
    """A model's chunked prefill (80-token chunks, ragged rows) through the flash kernel: the
    logits after each prompt match the reference path's, and generate's greedy tokens are the
    same."""
    import jaxspec
    from jaxspec.engines import programs

    changes = dict(num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=64, vocab_size=64)
    target = tiny.model(2, **changes)
    ps = tiny.prompts(2, lengths=(150, 97, 33), vocab=64)
    ids, lens = pad_prompts(ps, KernelConfig(prefill_chunk=80))
    assert ids.shape[1] == 160
    calls = []
    fn = P.prefill_attention
    monkeypatch.setattr(P, "prefill_attention", lambda *a, **k: calls.append(1) or fn(*a, **k))

    def run(impl):
        kernels = KernelConfig(prefill_chunk=80, attention=impl)
        programs._COMPILED.clear()  # so the spy sees this run's traces
        jax.clear_caches()
        cache = init_cache(target.config, 3, 176)
        net = target.net(kernels)
        first = jax.jit(lambda *a: prefill(net, *a)[0])(target.flat, cache, ids, lens)
        tokens = jaxspec.generate(target, ps, max_new_tokens=6, kernels=kernels).tokens
        return np.asarray(first), tokens

    ref_logits, ref_tokens = run("reference")
    assert not calls
    logits, tokens = run("interpret")
    assert calls, "the flash kernel was not traced"
    np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=1e-5)
    assert tokens == ref_tokens
    programs._COMPILED.clear()
    jax.clear_caches()


def test_flash_kernel_runs_per_device_under_tensor_parallelism():
    """A prefill chunk with q and K/V split by heads over 2 devices: the flash kernel runs on each
    device's heads through the dispatcher's custom_partitioning (no all-gather of the cache in
    the compiled program) and matches the reference."""
    from jax.sharding import NamedSharding, PartitionSpec

    kernel, clean = make_inputs(
        8, b=2, t=72, kh=2, g=2, s=160, n=72, lengths=[40, 88], dtype=jnp.float32
    )
    mask = causal_masks(2, 72, 72, [72, 30])
    kernel, clean = with_mask(kernel, mask), with_mask(clean, mask)
    mesh = jax.make_mesh(
        (2,), ("tp",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,)
    )
    heads = NamedSharding(mesh, PartitionSpec(None, None, "tp", None))
    rep = NamedSharding(mesh, PartitionSpec())
    q, k, v, length, bm = kernel
    args = tuple(jax.device_put(x, heads) for x in (q, k, v)) + (
        jax.device_put(length, rep),
        jax.device_put(bm, rep),
    )
    impl = "pallas_interpret" if INTERPRET else "pallas"
    fn = jax.jit(lambda *a: dispatch.attention(*a, impl=impl))
    hlo = fn.lower(*args).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    got = fn(*args)
    assert got.sharding.spec[2] == "tp"
    check(got, clean, jnp.float32)
