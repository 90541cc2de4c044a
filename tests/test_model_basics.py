"""The forward's block spec: cached decoding equals the full causal forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.config import ModelConfig
from jaxspec.model.kv_cache import causal_block, init_cache
from jaxspec.model.transformer import apply, new_model

CFG = ModelConfig(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


@pytest.mark.parametrize("seed", range(3))
def test_chunked_prefill_and_decode_equal_full_forward(seed):
    model = new_model(CFG, seed=seed)
    rng = np.random.RandomState(seed)
    lens = [11, 5]
    ids = rng.randint(0, CFG.vocab_size, (2, 11))
    full = [np.asarray(model.logits(ids[i : i + 1, : lens[i]]))[0] for i in range(2)]
    cache = init_cache(CFG, 2, 32)
    net = model.net()
    fwd = jax.jit(lambda p, t, c, b: apply(net, p, t, c, b))
    # chunk of 4 (ragged: row 1 only has 4 real tokens in the first chunk), then one at a time
    got = [[], []]
    pos = 0
    for chunk in (4, 1, 1, 1, 1, 1, 1, 1):
        valid = jnp.array([min(chunk, max(n - pos, 0)) for n in lens], jnp.int32)
        tok = jnp.asarray(
            np.pad(ids[:, pos : pos + chunk], ((0, 0), (0, max(0, chunk - ids[:, pos:].shape[1]))))
        )
        block = causal_block(cache.length, cache.length, valid, chunk)
        logits, cache = fwd(model.flat, tok, cache, block)
        cache.length = cache.length + valid
        for r in range(2):
            got[r].extend(np.asarray(logits[r, : int(valid[r])]))
        pos += chunk
    for r in range(2):
        np.testing.assert_allclose(np.stack(got[r]), full[r], atol=1e-5)


def test_truncate_keeps_the_first_layers_and_the_head():
    from jaxspec.model.transformer import truncate

    model = new_model(CFG, seed=4)
    ids = np.random.RandomState(4).randint(0, CFG.vocab_size, (1, 9))
    np.testing.assert_allclose(truncate(model, 2).logits(ids), model.logits(ids), atol=1e-6)
    one = truncate(model, 1)
    assert one.config.num_layers == 1 and len(one.params["layers"]) == 1
    assert one.params["embed_tokens"].value is model.params["embed_tokens"].value  # shared
    assert np.abs(np.asarray(one.logits(ids) - model.logits(ids))).max() > 1e-3
    with pytest.raises(jaxspec.OptionError):
        truncate(model, 0)


@pytest.mark.parametrize("where", ["gemm", "stream"])
def test_min_gemm_rows_padding_keeps_results(where):
    """The GEMM row padding settings (KernelConfig.gemm_rows, .row_padding: each matmul's rows
    or the whole residual stream) change kernels, not results: set on the model or passed to
    one call."""
    import jaxspec.model.transformer as jm
    from jaxspec.api import generate
    from jaxspec.kernels import KernelConfig
    from jaxspec.model.layers import stream_rows
    from tests import tiny

    m = tiny.model(3)
    ps = tiny.prompts(5)
    plain_logits = np.asarray(m.logits([ps[1]]))
    plain = generate(m, ps, max_new_tokens=12).tokens
    kernels = KernelConfig(gemm_rows=8, row_padding=where)
    resolved = kernels.resolve(m.config)
    assert stream_rows(1, resolved) == (8 if where == "stream" else None)
    assert stream_rows(9, resolved) == (16 if where == "stream" else None)
    assert [stream_rows(n, resolved) for n in (8, 16, 17)] == [None] * 3
    # the defaults (named, whatever backend runs the test): the CPU's pads nothing, the GPU's
    # pads a one-row stream to 8
    assert stream_rows(1, KernelConfig().resolve(m.config, backend="cpu")) is None
    assert stream_rows(1, KernelConfig().resolve(m.config, backend="gpu")) == 8
    padded = jm.with_params(m, m.params, kernels=kernels)
    assert padded.net().kernels == resolved and padded.net() != m.net()
    np.testing.assert_allclose(
        np.asarray(padded.logits([ps[1]])), plain_logits, rtol=1e-5, atol=1e-5
    )
    assert generate(padded, ps, max_new_tokens=12).tokens == plain
    r = generate(m, ps, method="chain", draft="ngram", max_new_tokens=12, kernels=kernels)
    assert r.call.prog.net.kernels.gemm_rows == 8 and r.tokens == plain
    assert generate(padded, ps, method="tree", draft="ngram", max_new_tokens=12).tokens == plain


def test_bf16_model_logits_keep_float32_precision():
    """A bf16 model's logits come from the matmul's float32 accumulator, not a bf16 rounding
    of it (which made exact top-2 ties, so greedy depended on kernel order)."""
    from tests import tiny

    m = tiny.model(4)
    m16 = jaxspec.model.transformer.Model(
        m.config, m.graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), m.params)
    )
    logits = np.asarray(m16.logits([tiny.prompts(1)[0]]))
    assert logits.dtype == np.float32
    rounded = np.asarray(jnp.asarray(logits).astype(jnp.bfloat16).astype(jnp.float32))
    assert (logits != rounded).mean() > 0.5
