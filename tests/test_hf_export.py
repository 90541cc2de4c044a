"""The HF exporter: a jaxspec Model as a transformers model gives the same logits and the same
greedy tokens (the benchmark's HF peers run exactly jaxspec's weights)."""

import dataclasses

import numpy as np
import pytest
import torch
from flax import nnx

import jaxspec
from jaxspec.io import hf_export
from jaxspec.model.transformer import new_model
from tests import hf_fixtures, tiny


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(input_ids=torch.as_tensor(np.asarray(tokens))).logits.float().numpy()


@pytest.mark.parametrize(
    "changes",
    [
        {},  # llama, GQA, untied
        {"tie_word_embeddings": True},
        {"family": "qwen2", "qkv_bias": True},
        {"rope_scaling": ("llama3", 8.0, 1.0, 4.0, 16), "rope_theta": 5e5},
    ],
    ids=["llama", "tied", "qwen2-bias", "llama3-rope"],
)
def test_exported_logits_equal_ours(changes):
    m = new_model(dataclasses.replace(tiny.CFG, **changes), seed=3)
    if changes.get("qkv_bias"):  # zero biases would hide a mis-mapped bias: randomise them
        pure = nnx.to_pure_dict(m.params)
        rng = np.random.RandomState(0)
        for layer in pure["layers"].values():
            for name in ("q_proj", "k_proj", "v_proj"):
                b = layer["self_attn"][name]["bias"]
                layer["self_attn"][name]["bias"] = 0.3 * rng.randn(*b.shape).astype(np.float32)
        nnx.replace_by_pure_dict(m.params, pure)
    tokens = np.random.RandomState(1).randint(0, tiny.CFG.vocab_size, (2, 37))
    ours = np.asarray(m.logits(tokens))
    hf = hf_export.to_hf(m)
    if changes.get("tie_word_embeddings"):
        assert hf.config.tie_word_embeddings
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    np.testing.assert_allclose(_hf_logits(hf, tokens), ours, atol=2e-5, rtol=1e-5)


def test_round_trip_through_the_converter_is_the_identity(tmp_path):
    """HF fixture -> jaxspec -> HF: the same state dict as the original HF model."""
    orig = hf_fixtures.save_hf_checkpoint("llama3.2", tmp_path / "hf")
    m = jaxspec.load(
        jaxspec.convert(tmp_path / "hf", tmp_path / "ck", dtype="float32", progress=False)
    )
    sd = hf_export.state_dict(m)
    want = {k: v.numpy() for k, v in orig.state_dict().items() if k != "lm_head.weight"}
    assert sorted(sd) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(sd[k], v, err_msg=k)


def test_exported_greedy_tokens_equal_ours():
    m = tiny.model(5)
    prompt = tiny.prompts(2, lengths=(9,))[0]
    ours = jaxspec.generate(m, [prompt], max_new_tokens=12).tokens[0]
    hf = hf_export.to_hf(m)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
        )
    assert out[0, len(prompt) :].tolist() == ours
