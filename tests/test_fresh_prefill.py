"""A prompt's first chunk through ``jax.nn.dot_product_attention`` (``KernelConfig.
prefill_attention``): cuDNN's flash attention on a GPU, the same call's XLA implementation here.

The block's own K/V are all its queries see when the cache was empty, so the call takes them and
no cache; any other block (a later chunk, a decode step, a tree) keeps the cache path. These tests
run the "xla" form on the CPU against the reference path and the "cudnn" form on a GPU
(``-m gpu``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.engines import programs
from jaxspec.errors import OptionError
from jaxspec.kernels import KernelConfig
from jaxspec.model import attention as A
from jaxspec.model.kv_cache import causal_block, init_cache
from jaxspec.model.prefill import pad_prompts, prefill
from jaxspec.model.transformer import new_model
from pallas_kernels.reference import attend
from tests import tiny

WIDE = dict(num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=64, vocab_size=64)


def block_inputs(seed, *, b, t, kh, g, valid, dtype, hd=64):
    """q/k/v of a causal block with ``valid[b]`` real tokens, and a cache holding its K/V at
    slots [0, t) and zeros after (for the reference; the call takes no cache)."""
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), dtype)
        for shape in ((b, t, kh * g, hd), (b, t, kh, hd), (b, t, kh, hd))
    )
    length = jnp.zeros((b,), jnp.int32)
    block = causal_block(length, length, jnp.asarray(valid, jnp.int32), t, fresh=True)
    pad = jnp.zeros((b, 16, kh, hd), dtype)
    return q, k, v, block, jnp.concatenate([k, pad], 1), jnp.concatenate([v, pad], 1)


@pytest.mark.parametrize("g, valid", [(1, [80, 80]), (3, [80, 1, 45])])
def test_causal_self_attention_matches_the_reference(g, valid):
    """Ragged rows (a row of one real token), GQA; padding queries return zeros."""
    q, k, v, block, kc, vc = block_inputs(g, b=len(valid), t=80, kh=2, g=g, valid=valid,
                                          dtype=jnp.float32)  # fmt: skip
    want = attend(q, kc, vc, jnp.zeros((len(valid),), jnp.int32), block.block_mask)
    got = A.causal_self_attention(q, k, v, block, "xla")
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for row, n in enumerate(valid):
        assert not np.asarray(got[row, n:]).any(), "a padding query saw something"


def test_which_blocks_take_it():
    """Only a prompt's first chunk (a fresh block) wider than the decode kernel's 64 queries, head
    sizes cuDNN takes, and 16-bit inputs for cuDNN."""
    xla, cudnn = KernelConfig(prefill_attention="xla"), KernelConfig(prefill_attention="cudnn")
    q, _, _, block, _, _ = block_inputs(0, b=1, t=80, kh=1, g=1, valid=[80], dtype=jnp.bfloat16)
    assert A.fresh_prefill(q, block, xla) == "xla"
    assert A.fresh_prefill(q, block, cudnn) == "cudnn"
    assert A.fresh_prefill(q.astype(jnp.float32), block, cudnn) is None
    assert A.fresh_prefill(q.astype(jnp.float32), block, xla) == "xla"
    assert A.fresh_prefill(q, block, KernelConfig(prefill_attention="off")) is None
    zero = jnp.zeros((1,), jnp.int32)
    later = causal_block(zero + 80, zero + 80, zero + 80, 80)  # a later chunk: not fresh
    assert A.fresh_prefill(q, later, xla) is None
    short = causal_block(zero, zero, zero + 64, 64, fresh=True)
    assert A.fresh_prefill(q[:, :64], short, xla) is None  # the decode kernel's width
    assert A.fresh_prefill(jnp.zeros((1, 80, 1, 256), jnp.bfloat16), block, cudnn) is None


def test_config_resolves_and_checks():
    cfg = tiny.CFG
    assert KernelConfig().resolve(cfg, backend="cpu").prefill_attention == "off"
    assert KernelConfig().resolve(cfg, backend="gpu").prefill_attention == "cudnn"
    assert KernelConfig().resolve(cfg, backend="gpu", sharded=True).prefill_attention == "off"
    exact = KernelConfig(invariant=True).resolve(cfg, backend="gpu")
    assert exact.prefill_attention == "off"
    with pytest.raises(OptionError, match="GPU backend"):
        KernelConfig(prefill_attention="cudnn").resolve(cfg, backend="cpu")
    with pytest.raises(OptionError, match="prefill_attention must be one of"):
        KernelConfig(prefill_attention="flash")
    env = {"JAXSPEC_PREFILL_ATTENTION": "xla"}
    assert KernelConfig.from_env(env).prefill_attention == "xla"
    with pytest.raises(OptionError, match="JAXSPEC_PREFILL_ATTENTION"):
        KernelConfig.from_env({"JAXSPEC_PREFILL_ATTENTION": "fast"})


def prefill_logits(target, kernels, ids, lens, cache):
    net = target.net(kernels)
    return jax.jit(lambda *a: prefill(net, *a))(target.flat, cache, ids, lens)


def test_prefill_and_generate_equal_the_cache_path(monkeypatch):
    """A chunked prefill (80-token chunks, ragged rows): the first chunk through the call, the
    second over the cache. Logits equal the reference path's, also for a prefill into a cache
    that held a prompt (written again from slot 0); greedy tokens (autoregressive and a chain
    with a draft) equal autoregressive decoding's."""
    target = tiny.model(5, **WIDE)
    draft = tiny.perturbed(target, 0.05, 1)
    ps = tiny.prompts(7, lengths=(150, 97, 33), vocab=64)
    ids, lens = pad_prompts(ps, KernelConfig(prefill_chunk=80))
    calls = []
    sdpa = jax.nn.dot_product_attention
    monkeypatch.setattr(
        jax.nn, "dot_product_attention", lambda *a, **k: calls.append(k) or sdpa(*a, **k)
    )

    def run(mode):
        kernels = KernelConfig(prefill_chunk=80, attention="reference", prefill_attention=mode)
        programs._COMPILED.clear()
        jax.clear_caches()
        first, cache = prefill_logits(target, kernels, ids, lens, init_cache(target.config, 3, 352))
        # into the cache that prompt filled: overwritten from slot 0, the same logits
        again, _ = prefill_logits(target, kernels, ids, lens, cache)
        ar = jaxspec.generate(target, ps, max_new_tokens=6, kernels=kernels).tokens
        chain = jaxspec.generate(target, ps, max_new_tokens=6, kernels=kernels, draft=draft,
                                 method="chain").tokens  # fmt: skip
        return np.asarray(first), np.asarray(again), ar, chain

    ref = run("off")
    assert not calls
    got = run("xla")
    assert calls and all(c["implementation"] == "xla" and c["is_causal"] for c in calls)
    np.testing.assert_allclose(got[0], ref[0], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got[1], ref[0], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(ref[1], ref[0], atol=2e-5, rtol=1e-5)
    assert got[2] == ref[2] and got[3] == ref[2]
    programs._COMPILED.clear()
    jax.clear_caches()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cudnn_on_the_gpu(dtype):
    """cuDNN's flash attention (compiled, on a GPU) against the reference in float32."""
    valid = [300, 1, 177]
    q, k, v, block, kc, vc = block_inputs(9, b=3, t=300, kh=3, g=3, valid=valid, dtype=dtype)
    f32 = [x.astype(jnp.float32) for x in (q, kc, vc)]
    want = attend(*f32, jnp.zeros((3,), jnp.int32), block.block_mask)
    got = jax.jit(lambda *a: A.causal_self_attention(*a, block, "cudnn"))(q, k, v)
    assert "cudnn" in jax.jit(lambda *a: A.causal_self_attention(*a, block, "cudnn")).lower(
        q, k, v).as_text().lower()  # fmt: skip
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)
    for row, n in enumerate(valid):
        assert not np.asarray(got[row, n:], np.float32).any()


@pytest.mark.gpu
def test_cudnn_prefill_on_the_gpu():
    """A bf16 model's chunked prefill with cuDNN for its first chunk: logits within bf16 rounding
    of the flash kernel's path (the cache path for both chunks)."""
    target = new_model(dataclasses.replace(tiny.CFG, **WIDE), seed=5, dtype=jnp.bfloat16)
    ps = tiny.prompts(7, lengths=(150, 97, 33), vocab=64)
    ids, lens = pad_prompts(ps, KernelConfig(prefill_chunk=80))
    out = {}
    for mode in ("off", "cudnn"):
        kernels = KernelConfig(prefill_chunk=80, prefill_attention=mode)
        cache = init_cache(target.config, 3, 352, target.dtype)
        out[mode] = np.asarray(prefill_logits(target, kernels, ids, lens, cache)[0])
    np.testing.assert_allclose(out["cudnn"], out["off"], atol=5e-2, rtol=5e-2)
