"""Losslessness relative to a quantized target: every engine and draft kind, with a quantized
target, a quantized draft or both, returns exactly the quantized target's autoregressive greedy
tokens (float32), on one device and tensor parallel; the dequantizing kernels (interpreted on
CPU) decode exactly as the XLA path; sampling follows the quantized target's distribution
(chi-square against exact enumeration, with a negative control that must fail)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.engines import chain as chain_engine
from jaxspec.engines import programs
from jaxspec.model import quantized as Q
from jaxspec.model import sharding
from jaxspec.model.feature_head import random_head
from jaxspec.model.transformer import with_params
from pallas_kernels import fused_linear, quant, quant_linear
from tests import test_sampling_engines as sampling
from tests import tiny

NEW = 12
TREE = dict(depth=2, width=2, branch=2, bs=4)
# (bits, group): a scale per channel for int8; int4 in groups of 16 rows (tiny's hidden is 32)
FORMATS = {"int8": (8, None), "int4": (4, 16)}


def with_mins(model: jaxspec.Model, seed: int) -> jaxspec.Model:
    """``model`` with every 4-bit weight in the asymmetric layout of GGUF Q4_1 and AWQ
    (w = q * s + m), which symmetric ``quantize`` never makes: m = -8 s (the symmetric zero)
    plus noise of a tenth of a step, so the model stays close to the float one."""
    rng = np.random.default_rng(seed)

    def one(x):
        if not quant.is_quantized(x) or x.bits != 4:
            return x
        s = np.asarray(x.scales, np.float32)
        low = jax.numpy.asarray(s * (rng.normal(0, 0.1, s.shape) - 8), jax.numpy.float16)
        return quant.QuantizedWeight(x.values, x.scales, low, 4, x.group, x.dtype)

    pure = jax.tree.map(one, nnx.to_pure_dict(model.params), is_leaf=quant.is_quantized)
    state = jax.tree.map(lambda x: x, model.params)
    nnx.replace_by_pure_dict(state, pure)
    return with_params(model, state)


def pair(seed: int, target_fmt: str | None, draft_fmt: str | None, **changes):
    """(target, draft, prompts): a tiny target and a perturbed draft, each quantized in its
    format (None: float)."""
    target = tiny.model(seed, **changes)
    draft = tiny.perturbed(target, 0.3, seed)
    if target_fmt:
        target = with_mins(Q.quantize_model(target, *FORMATS[target_fmt]), seed)
    if draft_fmt:
        draft = Q.quantize_model(draft, *FORMATS[draft_fmt])
    return target, draft, tiny.prompts(seed, vocab=target.config.vocab_size)


@pytest.fixture(autouse=True)
def fresh_compiles():
    yield
    programs._COMPILED.clear()
    jax.clear_caches()


# the default run: both models quantized; one of them alone is the same code paths (slow)
@pytest.mark.parametrize(
    "target_fmt, draft_fmt",
    [
        ("int8", "int4"),
        pytest.param("int4", None, marks=pytest.mark.slow),
        pytest.param(None, "int8", marks=pytest.mark.slow),
    ],
)
def test_chain_and_tree_return_the_quantized_targets_greedy_tokens(target_fmt, draft_fmt):
    target, draft, ps = pair(1, target_fmt, draft_fmt)
    assert Q.is_quantized_model(target) == bool(target_fmt)
    ref = jaxspec.generate(target, ps, max_new_tokens=NEW).tokens
    chain = jaxspec.generate(target, ps, draft=draft, method="chain", max_new_tokens=NEW, gamma=3)
    tree = jaxspec.generate(target, ps, draft=draft, method="tree", max_new_tokens=NEW, **TREE)
    assert chain.tokens == ref and tree.tokens == ref
    assert chain.stats["acceptance_length"] > 1.0  # the draft agrees sometimes: a real test


KINDS = ("ngram", "self-streaming", "self-snapkv", "feature")


def test_draft_kinds_of_a_quantized_target_return_its_greedy_tokens():
    """Each draft kind over one int4 target (Q4_1-style offsets), its reference computed once:
    prompt lookup, the streaming and SnapKV self-drafts (magicdec), and a feature head, which
    reads the target's states and shares its embedding and LM head (dequantized for the head)."""
    target, _, _ = pair(2, "int4", None)
    ps = tiny.prompts(2, lengths=(40, 5, 23))  # longer than the sparse budget, and shorter
    ref = jaxspec.generate(target, ps, max_new_tokens=NEW).tokens
    for kind in KINDS:
        draft = random_head(target) if kind == "feature" else kind
        method = "magicdec" if kind == "self-snapkv" else "chain"
        opts = dict(budget=20, gamma=2) if kind.startswith("self") else dict(gamma=3)
        r = jaxspec.generate(target, ps, draft=draft, method=method, max_new_tokens=NEW, **opts)
        assert r.tokens == ref, kind


@pytest.mark.slow
def test_a_feature_head_of_a_quantized_target_in_a_tree():
    target, _, ps = pair(6, "int8", None)
    ref = jaxspec.generate(target, ps, max_new_tokens=NEW).tokens
    r = jaxspec.generate(
        target, ps, draft=random_head(target), method="tree", max_new_tokens=NEW, **TREE
    )
    assert r.tokens == ref


# magicdec with a quantized target runs in the default run above (self-snapkv)
@pytest.mark.slow
@pytest.mark.parametrize("method", ["magicdec", "swiftspec"])
def test_magicdec_and_swiftspec_with_both_models_quantized(method):
    target, draft, ps = pair(3, "int8", "int4", num_heads=4, num_kv_heads=4, vocab_size=64)
    ps = ps[:2]
    ref = jaxspec.generate(target, ps, max_new_tokens=NEW).tokens
    opts = dict(gamma=2, sparse="dense") if method == "magicdec" else TREE
    r = jaxspec.generate(target, ps, draft=draft, method=method, max_new_tokens=NEW, **opts)
    assert r.tokens == ref


def test_a_quantized_model_on_a_tensor_parallel_mesh_decodes_as_on_one_device():
    target, _, ps = pair(4, "int4", None, num_heads=4, num_kv_heads=4, vocab_size=64)
    ref = jaxspec.generate(target, ps, max_new_tokens=NEW).tokens
    placed, _ = sharding.place(target, jax.devices()[:2])
    values = nnx.to_pure_dict(placed.params)["layers"][0]["mlp"]["down_proj"]["kernel"].values
    assert len(values.sharding.device_set) == 2  # row parallel: the packed rows are split
    assert jaxspec.generate(placed, ps, max_new_tokens=NEW).tokens == ref


def test_the_quantized_model_is_the_dequantized_model():
    """Logits of a quantized model (dequantized inside the program) equal those of the float
    model it stands for, within float32 rounding; the embedding of a tied model is its head."""
    target, _, ps = pair(5, "int4", None, tie_word_embeddings=True)
    table = nnx.to_pure_dict(target.params)["embed_tokens"]
    assert quant.is_quantized(table) and table.shape == (32, tiny.CFG.vocab_size)
    dense = Q.dequantize_model(target)
    assert not Q.is_quantized_model(dense)
    got, want = np.asarray(target.logits(ps[0])), np.asarray(dense.logits(ps[0]))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow
def test_the_quantized_model_generates_the_dequantized_models_tokens():
    target, _, ps = pair(5, "int4", None, tie_word_embeddings=True)
    assert jaxspec.generate(target, ps, max_new_tokens=NEW).tokens == (
        jaxspec.generate(Q.dequantize_model(target), ps, max_new_tokens=NEW).tokens
    )


@pytest.mark.slow
def test_decoding_through_the_dequantizing_kernels_equals_the_xla_path(monkeypatch):
    """Greedy tokens (float32) of autoregressive and chain decoding with every decode and verify
    step's projections through the kernels (interpreted): the plain path's qmatmul, then the
    split-K projection kernels over quantized weights, equal the XLA path's."""
    target, draft, ps = pair(6, "int4", "int8", hidden_size=64, head_dim=64, intermediate_size=96)
    calls = {"qmatmul": 0, "fused": 0}
    real_q, real_f = quant_linear.qmatmul, fused_linear.silu_project

    def count(name, fn):
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)

    monkeypatch.setattr(quant_linear, "qmatmul", count("qmatmul", real_q))
    monkeypatch.setattr(fused_linear, "silu_project", count("fused", real_f))
    plain = jaxspec.KernelConfig(quant_matmul="xla")
    runs = {}
    for name, kernels in (
        ("xla", plain),
        ("qmatmul", jaxspec.KernelConfig(quant_matmul="interpret")),
        ("fused", jaxspec.KernelConfig(quant_matmul="interpret", fused_linear="interpret")),
    ):
        ar = jaxspec.generate(target, ps, max_new_tokens=8, kernels=kernels)
        ch = jaxspec.generate(
            target, ps, draft=draft, method="chain", max_new_tokens=8, gamma=2, kernels=kernels
        )
        runs[name] = (ar.tokens, ch.tokens)
    assert calls["qmatmul"] and calls["fused"], calls  # both kernel paths were traced
    assert runs["qmatmul"] == runs["xla"] == runs["fused"]
    assert runs["xla"][1] == runs["xla"][0]


def _sampling_models():
    target, draft = sampling.models()
    return Q.quantize_model(target, 4, 16), Q.quantize_model(draft, 8)


@pytest.mark.slow
def test_sampling_follows_the_quantized_targets_distribution(monkeypatch):
    """Chain speculation (quantized target and draft) draws the quantized target's joint law of
    three tokens (exact enumeration); a rule that accepts every draft token is rejected."""
    target, draft = _sampling_models()
    want = sampling.exact_joint(target)
    got = sampling.sampled_joint(target, draft, "chain", gamma=2)
    rejects, stat, crit = sampling.chi_square_rejects(got, want)
    assert not rejects, (stat, crit)
    monkeypatch.setattr(chain_engine, "accept_chain", sampling.accept_everything_chain)
    programs._COMPILED.clear()
    jax.clear_caches()  # else the traced chain step keeps the real rule (and the control passes)
    rejects, stat, crit = sampling.chi_square_rejects(
        sampling.sampled_joint(target, draft, "chain", gamma=2), want
    )
    assert rejects, (stat, crit)
