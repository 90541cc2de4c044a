"""Converted checkpoints give the logits of the torch float32 HF model, for every family,
from single-file and sharded safetensors, from GGUF (llama.cpp layout), on one device and
tensor-parallel over a 2-device mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.io.convert import convert, load
from jaxspec.model.transformer import Model, abstract_model
from tests.hf_fixtures import (
    FAMILIES,
    VOCAB,
    hf_logits,
    make_tokenizer,
    save_hf_checkpoint,
    write_gguf,
)

ATOL = 1e-4


def _tokens(seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (2, 37))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (converted float32 checkpoint, torch model), each converted once."""
    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(family)
            model = save_hf_checkpoint(family, root / "hf", tokenizer=family == "smollm2")
            ckpt = convert(root / "hf", root / "ckpt", dtype="float32", progress=False)
            cache[family] = ckpt, model
        return cache[family]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf(family, converted):
    ckpt, hf = converted(family)
    model = load(ckpt)
    assert model.dtype == jnp.float32
    assert model.config.family == {"qwen2": "qwen2", "mistral": "mistral"}.get(family, "llama")
    tokens = _tokens()
    want = hf_logits(hf, tokens)
    assert want.std() > 0.5  # the comparison is not trivially small
    got = np.asarray(model.logits(tokens))
    assert got.shape == (2, 37, VOCAB)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def test_llama3_rope_scaling_is_exercised(converted):
    """Dropping the llama3 scaling must change the logits, or the parity above proves little."""
    ckpt, hf = converted("llama3.1")
    model = load(ckpt)
    assert model.config.rope_scaling == ("llama3", 8.0, 1.0, 4.0, 16)
    cfg = dataclasses.replace(model.config, rope_scaling=None)
    unscaled = Model(cfg, abstract_model(cfg)[0], model.params)
    tokens = _tokens()
    assert np.abs(np.asarray(unscaled.logits(tokens)) - hf_logits(hf, tokens)).max() > 1e-2


def test_sharded_safetensors(tmp_path):
    hf = save_hf_checkpoint("qwen2", tmp_path / "hf", seed=3, max_shard_size="40KB")
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model = load(convert(tmp_path / "hf", tmp_path / "ckpt", dtype="float32", progress=False))
    tokens = _tokens(1)
    np.testing.assert_allclose(
        np.asarray(model.logits(tokens)), hf_logits(hf, tokens), rtol=0, atol=ATOL
    )


def test_tokenizer_travels(converted):
    ckpt, _ = converted("smollm2")
    assert (ckpt / "tokenizer").is_dir()
    tok = load(ckpt).tokenizer
    text = "w5 w17 w93 w4"
    assert tok.encode(text, add_special_tokens=False) == make_tokenizer().encode(
        text, add_special_tokens=False
    )
    assert load(converted("qwen2")[0]).tokenizer is None  # source without tokenizer files


def test_dtype_default_and_cast(tmp_path, converted):
    ckpt32, hf = converted("llama2")
    ckpt16 = convert(ckpt32.parent / "hf", tmp_path / "bf16", progress=False)
    m16 = load(ckpt16)
    assert m16.dtype == jnp.bfloat16
    assert load(ckpt16, dtype="float32").dtype == jnp.float32
    m = load(ckpt32, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(m.params)} == {jnp.dtype(jnp.bfloat16)}
    tokens = _tokens()
    # bfloat16 weights: close to float32, not equal
    assert np.abs(np.asarray(m.logits(tokens)) - hf_logits(hf, tokens)).max() < 0.5


def test_load_onto_mesh(converted):
    ckpt, hf = converted("llama3.1")
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    model = load(ckpt, mesh=mesh)
    p = model.params
    q = p["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
    down = p["layers"][1]["mlp"]["down_proj"]["kernel"][...]
    emb = p["embed_tokens"][...]
    norm = p["norm"]["weight"][...]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0], q.shape[1] // 2)}
    assert {s.data.shape for s in down.addressable_shards} == {(down.shape[0] // 2, down.shape[1])}
    assert {s.data.shape for s in emb.addressable_shards} == {(VOCAB // 2, emb.shape[1])}
    assert norm.sharding.is_fully_replicated
    assert {d.id for d in q.sharding.device_set} == {d.id for d in jax.devices()[:2]}
    tokens = _tokens()
    got = np.asarray(model.logits(tokens))
    np.testing.assert_allclose(got, hf_logits(hf, tokens), rtol=0, atol=ATOL)
    np.testing.assert_allclose(got, np.asarray(load(ckpt).logits(tokens)), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "family,arch", [("llama3.1", "llama"), ("smollm2", "llama"), ("qwen2", "qwen2")]
)
def test_gguf_llama_cpp_layout(family, arch, tmp_path):
    """An F32 GGUF written as llama.cpp's converter does (q/k rows permuted for llama, llama3
    scaling as rope_freqs, tied output dropped) converts back to the HF model's logits."""
    hf = save_hf_checkpoint(family, tmp_path / "hf", seed=5)
    gguf_path = write_gguf(hf, tmp_path / "m.gguf", arch=arch)
    ckpt = convert(gguf_path, tmp_path / "ckpt", dtype="float32", progress=False)
    model = load(ckpt)
    ref = load(convert(tmp_path / "hf", tmp_path / "ref", dtype="float32", progress=False))
    cfg, want_cfg = model.config, ref.config
    for field in ("vocab_size", "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(cfg, field) == getattr(want_cfg, field), field
    assert cfg.qkv_bias == want_cfg.qkv_bias
    assert cfg.rope_theta == pytest.approx(want_cfg.rope_theta)
    assert cfg.rope_scaling == want_cfg.rope_scaling
    assert model.tokenizer is None
    tokens = _tokens(2)
    np.testing.assert_allclose(
        np.asarray(model.logits(tokens)), hf_logits(hf, tokens), rtol=0, atol=ATOL
    )
