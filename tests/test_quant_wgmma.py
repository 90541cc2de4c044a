"""Hopper's WGMMA kernel for quantized projections (pallas_kernels/quant_wgmma.py) and the
K-major layout it reads.

On a CPU: the layout is checked exactly (its dequantization equals the stored weight's bit for
bit; int4 codes land signed and in K's order), models laid out in it decode exactly as the
stored layout does in every engine, the kernel is lowered for CUDA (Mosaic GPU's own shape and
layout checks), and it runs in Mosaic GPU's interpreter (``interpret=True``: the same program,
its register operand staged through shared memory, the interpreter's only operand kind) against
the float32 dequantize-then-matmul on fresh inputs, its output buffers NaN-filled until written.
Compiled, its products are checked on the GPU (tests marked ``gpu``, and bench_quantized.py's
``check`` section)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.config import ModelConfig
from jaxspec.kernels import KernelConfig
from jaxspec.model import quantized as Q
from jaxspec.model import sharding
from jaxspec.model.layers import project
from jaxspec.model.transformer import new_model
from pallas_kernels import quant, quant_linear
from pallas_kernels import quant_wgmma as qw
from tests import tiny

# (bits, group) the kernel takes: a scale per output channel (int8), groups of 128 (int4), and
# int4 in groups of 256 (two K steps a scale row)
LAYOUTS = [(8, None), (4, 128), (4, 256), (8, 256)]
CFG = ModelConfig(  # every projection's K a multiple of 256 and N of 64
    vocab_size=192,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    max_position_embeddings=512,
)


def random_weight(rng, k, n, bits, group, scale_dtype, dtype=jnp.bfloat16):
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    return quant.quantize(w.astype(dtype), bits, group, scale_dtype=scale_dtype)


@pytest.mark.parametrize("bits, group", LAYOUTS)
@pytest.mark.parametrize("scale_dtype", [jnp.bfloat16, jnp.float32])
def test_the_k_major_layout_dequantizes_to_the_stored_weight_bit_for_bit(bits, group, scale_dtype):
    rng = np.random.default_rng(bits + (group or 0))
    w = random_weight(rng, 512, 192, bits, group, scale_dtype)
    kw = qw.prepare(w)
    assert kw.shape == w.shape and kw.nbytes == w.nbytes
    assert kw.values.dtype == (jnp.int8 if bits == 8 else jnp.int4)
    for dtype in (jnp.bfloat16, jnp.float32):
        np.testing.assert_array_equal(
            np.asarray(qw.dequantize(kw, dtype)), np.asarray(quant.dequantize(w, dtype))
        )


@pytest.mark.parametrize("group", [128, 256])
def test_int4_codes_are_laid_out_signed_in_k_order(group):
    """GGUF's nibble order (rows j and j + G/2 a byte) becomes K's own: the int4 array's element
    ``[n, k]`` is row k's code of column n, as the signed ``q`` (stored ``q + 8``)."""
    rng = np.random.default_rng(group)
    k, n = 512, 128
    codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
    w = quant.QuantizedWeight(
        quant.pack4(codes, group), jnp.ones((k // group, n), jnp.bfloat16), None, 4, group,
        "float32",
    )  # fmt: skip
    kw = qw.prepare(w)
    assert kw.values.dtype == jnp.int4 and kw.values.shape == (n, k)
    np.testing.assert_array_equal(
        np.asarray(kw.values.astype(jnp.int8)), codes.T.astype(np.int8) - quant.OFFSET4
    )


def test_weights_the_kernel_cannot_take_say_why():
    rng = np.random.default_rng(0)
    assert "mins" in qw.unsupported_weight(
        dataclasses.replace(
            random_weight(rng, 256, 64, 4, 128, jnp.float16),
            mins=jnp.zeros((2, 64), jnp.float16),
        )
    )
    assert "whole" in qw.unsupported_weight(random_weight(rng, 256, 64, 4, 32, jnp.float16))
    assert "multiple of 64" in qw.unsupported_weight(random_weight(rng, 256, 96, 8, None, None))
    assert "not quantized" in qw.unsupported_weight(jnp.ones((256, 64)))
    with pytest.raises(ValueError, match="whole"):
        qw.prepare(random_weight(rng, 320, 64, 8, None, jnp.bfloat16))
    kw = qw.prepare(random_weight(rng, 256, 64, 8, None, jnp.bfloat16, dtype=jnp.float32))
    assert "bf16/f16" in qw.unsupported_reason(jnp.ones((8, 256), jnp.float32), kw)
    kw = kw.__class__(kw.values, kw.scales, kw.bits, kw.group, "bfloat16")
    assert qw.unsupported_reason(jnp.ones((8, 256), jnp.bfloat16), kw) is None
    assert "rows not in" in qw.unsupported_reason(jnp.ones((17, 256), jnp.bfloat16), kw)


def test_plan_cuts_k_into_equal_splits():
    assert qw.plan(4096, 14336, 256, None) == (1, 16)  # 224 programs already
    assert qw.plan(14336, 4096, 256, None) == (4, 14)  # 64 column tiles: 4 splits
    assert qw.plan(4096, 1024, 128, None) == (16, 2)
    for k, n, bk, splits in ((4096, 128, 256, 7), (14336, 64, 128, 1000), (512, 64, 256, None)):
        s, per = qw.plan(k, n, bk, splits)
        assert s * per * bk == k


@pytest.mark.parametrize(
    "bits, group, rows, scale_dtype, widths, splits",
    [
        (8, None, 8, jnp.bfloat16, (512,), None),  # one group a split: scales after its last step
        (8, None, 16, jnp.float32, (512,), None),
        (4, 128, 8, jnp.bfloat16, (512,), 1),  # 8 one-group steps a split: each step's sum scaled
        (8, None, 8, jnp.bfloat16, (256, 64, 64), None),  # q, k, v in one launch (64-channel tiles)
        (4, 128, 16, jnp.bfloat16, (384, 384), None),  # gate and up
        (4, 256, 8, jnp.bfloat16, (512,), 2),  # groups of 2 steps inside 4-step splits
    ],
)
def test_the_kernel_lowers_for_cuda(bits, group, rows, scale_dtype, widths, splits):
    """Lowered for CUDA here: Mosaic GPU's Python side builds the kernel (TMA transforms, the
    upcast register layouts, the WGMMA's operand shapes) and raises on any mismatch."""
    rng = np.random.default_rng(1)
    ws = tuple(qw.prepare(random_weight(rng, 1024, c, bits, group, scale_dtype)) for c in widths)
    x = jax.ShapeDtypeStruct((rows, 1024), jnp.bfloat16)
    lowered = qw.qmatmul_partials.trace(x, ws, splits=splits).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text and f"tensor<{rows}x1024xbf16>" in text


def test_scales_apply_once_a_split_only_where_it_lies_in_one_group():
    assert qw.one_group_a_split(per_group=16, per=16)  # int8 per channel, one split
    assert qw.one_group_a_split(per_group=16, per=4)  # four splits, each inside the group
    assert qw.one_group_a_split(per_group=1, per=1)  # one step a split
    assert not qw.one_group_a_split(per_group=1, per=8)  # int4: each step's sum scaled
    assert not qw.one_group_a_split(per_group=2, per=4)  # groups end inside a split


@pytest.mark.parametrize(
    "bits, group, rows, scale_dtype, widths, splits",
    [
        (8, None, 1, jnp.bfloat16, (256,), None),  # one group a split: scaled after its last step
        (8, None, 13, jnp.float32, (256,), 2),
        (4, 128, 8, jnp.bfloat16, (256,), 1),  # 8 steps a split, each step's sum scaled
        (4, 256, 16, jnp.bfloat16, (256,), 2),  # groups of 2 steps inside 4-step splits
        (4, 128, 8, jnp.float32, (256,), None),  # one step a split (the plan's 8 splits)
        (8, None, 8, jnp.bfloat16, (128, 64, 64), None),  # q, k, v in one launch
        (4, 128, 5, jnp.bfloat16, (128, 128), 1),  # gate and up
    ],
)
def test_the_kernel_interpreted_multiplies_as_dequantize_then_matmul_in_float32(
    bits, group, rows, scale_dtype, widths, splits
):
    """Mosaic GPU's interpreter runs the kernel (TMA pipeline, the upcast loads, the scales on
    the accumulator, splits, several weights a launch) on fresh inputs: within float32 summation
    order of ``reference``. Negative control: the bf16-rounded weights' product (the scales on
    the weights, as before) is farther off than the tolerance."""
    rng = np.random.default_rng(rows * 31 + bits + len(widths))
    ws = [random_weight(rng, 1024, c, bits, group, scale_dtype) for c in widths]
    x = jnp.asarray(rng.standard_normal((rows, 1024)), jnp.bfloat16)
    got = np.asarray(qw.qmatmul(x, tuple(qw.prepare(w) for w in ws), splits=splits, interpret=True))
    want = np.concatenate([np.asarray(qw.reference(x, w)) for w in ws], axis=1)
    assert got.shape == (rows, sum(widths)) and np.isfinite(got).all()
    tol = 1e-5 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    rounded = np.concatenate(
        [np.asarray(quant_linear.qmatmul_reference(x, w)) for w in ws], axis=1
    )  # fmt: skip
    assert np.abs(rounded - want).max() > 10 * tol


def test_weights_that_cannot_share_a_launch_say_why():
    rng = np.random.default_rng(2)
    a = qw.prepare(random_weight(rng, 512, 128, 4, 128, jnp.bfloat16))
    assert qw.group_problem((a, qw.prepare(random_weight(rng, 512, 128, 4, 256, None)))) is None
    assert "different K" in qw.group_problem(
        (a, qw.prepare(random_weight(rng, 256, 64, 4, 128, None)))
    )
    assert "different K" in qw.group_problem(
        (a, qw.prepare(random_weight(rng, 512, 64, 8, None, None)))
    )
    with pytest.raises(ValueError, match="different K"):
        qw.qmatmul_partials(
            jnp.ones((8, 512), jnp.bfloat16),
            (a, qw.prepare(random_weight(rng, 512, 64, 8, None, None))),
        )


def _kmajor_pair(seed: int, dtype=jnp.float32):
    model = new_model(CFG, seed=seed, dtype=dtype)
    target = Q.quantize_model(model, 8)
    draft = Q.quantize_model(tiny.perturbed(model, 0.3, seed), 4, 128)
    return target, draft


def test_a_k_major_model_decodes_as_the_stored_layout_in_every_engine():
    """float32, the XLA path (the kernel is the GPU's): laid out K-major, a quantized target and
    draft give the stored layout's autoregressive tokens in chain, tree and magicdec."""
    target, draft = _kmajor_pair(3)
    kt, kd = Q.kmajor_model(target), Q.kmajor_model(draft)
    leaves = jax.tree.leaves(kt.params, is_leaf=lambda x: isinstance(x, qw.KMajorWeight))
    laid = [x for x in leaves if isinstance(x, qw.KMajorWeight)]
    assert len(laid) == 2 * 7 + 1 and Q.is_quantized_model(kt)  # the projections and LM head
    ps = tiny.prompts(3, lengths=(21, 4, 9), vocab=CFG.vocab_size)
    ref = jaxspec.generate(target, ps, max_new_tokens=10).tokens
    assert jaxspec.generate(kt, ps, max_new_tokens=10).tokens == ref
    for method, opts in (
        ("chain", dict(gamma=3)),
        ("tree", dict(depth=2, width=2, branch=2, bs=4)),
        ("magicdec", dict(gamma=2, sparse="dense")),
    ):
        r = jaxspec.generate(kt, ps, draft=kd, method=method, max_new_tokens=10, **opts)
        assert r.tokens == ref, method
        assert r.stats["acceptance_length"] > 1.0, method  # the draft agrees sometimes
    dense = Q.dequantize_model(kt)
    assert not Q.is_quantized_model(dense)
    assert jaxspec.generate(dense, ps, max_new_tokens=10).tokens == ref


@pytest.mark.parametrize("tp", ["gspmd", "shard_map"])
def test_a_k_major_model_on_a_mesh_splits_its_codes_and_decodes_as_on_one_device(tp):
    """A laid-out int4 model (groups of 128) placed on 2 devices: codes and scales split as the
    stored layout's rule with the codes' axes swapped (q_proj by output channel, o_proj by K at
    group boundaries), and its greedy tokens are the stored layout's on one device (float32)."""
    _, target = _kmajor_pair(5)
    kt = Q.kmajor_model(target)
    ps = tiny.prompts(5, lengths=(12, 5), vocab=CFG.vocab_size)
    ref = jaxspec.generate(target, ps, max_new_tokens=8).tokens
    placed = sharding.place(kt, jax.devices()[:2])[0]
    attn = nnx.to_pure_dict(placed.params)["layers"][0]["self_attn"]
    q, o = attn["q_proj"]["kernel"], attn["o_proj"]["kernel"]
    assert isinstance(q, qw.KMajorWeight) and isinstance(o, qw.KMajorWeight)
    assert q.values.sharding.spec[0] == "tp" and q.scales.sharding.spec[1] == "tp"
    assert o.values.sharding.spec[1] == "tp" and o.scales.sharding.spec[0] == "tp"
    assert len(q.values.addressable_shards) == 2
    assert q.values.addressable_shards[0].data.shape == (q.values.shape[0] // 2, q.values.shape[1])
    kernels = KernelConfig(tensor_parallel=tp)
    assert jaxspec.generate(placed, ps, max_new_tokens=8, kernels=kernels).tokens == ref


def test_for_wgmma_lays_out_only_where_the_kernel_runs(monkeypatch):
    import jaxspec.kernels

    target, _ = _kmajor_pair(4, jnp.bfloat16)
    assert Q.for_wgmma(target) is target  # this CPU is no sm_90 GPU
    monkeypatch.setattr(qw, "device_supported", lambda device=None: True)
    assert jaxspec.kernels.linear_fits(CFG)
    assert Q.for_wgmma(target) is target  # its small layers take the fused split-K kernels
    monkeypatch.setattr(jaxspec.kernels, "linear_fits", lambda cfg: False)
    laid = Q.for_wgmma(target)
    down = laid.params["layers"][0]["mlp"]["down_proj"]["kernel"].get_value()
    assert isinstance(down, qw.KMajorWeight) and down.bits == 8
    f32, _ = _kmajor_pair(4, jnp.float32)
    assert Q.for_wgmma(f32) is f32  # float32 compute: the WGMMA would round to tf32


def test_wgmma_takes_says_whether_load_would_keep_the_weights(monkeypatch):
    """``load``'s GPU default keeps a checkpoint's weights quantized where the kernel takes them."""
    import jaxspec.kernels

    int8 = {"layers.0.mlp.up_proj.kernel": dict(bits=8, group=256, scales="bfloat16", mins=None)}
    q4_1 = {"layers.0.mlp.up_proj.kernel": dict(bits=4, group=32, scales="float16", mins="float16")}
    embed = {"embed_tokens": dict(bits=8, group=256, scales="bfloat16", mins=None)}
    assert not Q.wgmma_takes(CFG, jnp.bfloat16, int8)  # no sm_90 GPU here
    monkeypatch.setattr(qw, "device_supported", lambda device=None: True)
    monkeypatch.setattr(jaxspec.kernels, "linear_fits", lambda cfg: False)
    assert Q.wgmma_takes(CFG, jnp.bfloat16, int8)
    assert not Q.wgmma_takes(CFG, jnp.float32, int8)
    assert not Q.wgmma_takes(CFG, jnp.bfloat16, q4_1)  # mins, groups of 32: Triton's kernel
    assert not Q.wgmma_takes(CFG, jnp.bfloat16, embed)  # the embedding is never laid out


def test_project_takes_a_k_major_weight_through_the_xla_path_exactly():
    rng = np.random.default_rng(5)
    w = random_weight(rng, 512, 192, 4, 128, jnp.bfloat16, dtype=jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, 512)), jnp.float32)
    kernels = KernelConfig().resolve(CFG)
    want = project(x, w, kernels)
    np.testing.assert_array_equal(np.asarray(project(x, qw.prepare(w), kernels)), want)


def test_project_many_splits_one_launch_back_into_each_weights_product(monkeypatch):
    """q, k and v through one launch come back in their order and shapes (the kernel replaced by
    the concatenated reference: the GPU tests check the kernel's own products)."""
    from jaxspec.model.layers import project_many

    launches = []

    def reference(x, ws, **_):
        launches.append(len(ws))
        dense = jnp.concatenate([qw.dequantize(w, jnp.bfloat16) for w in ws], axis=1)
        return jnp.matmul(x, dense, preferred_element_type=jnp.float32)

    monkeypatch.setattr(qw, "qmatmul", reference)
    rng = np.random.default_rng(9)
    ws = [qw.prepare(random_weight(rng, 512, c, 8, None, jnp.bfloat16)) for c in (256, 64, 64)]
    x = jnp.asarray(rng.standard_normal((1, 8, 512)), jnp.bfloat16)
    xla = KernelConfig().resolve(CFG)  # this CPU's: quant_matmul "xla"
    got = project_many(x, ws, dataclasses.replace(xla, quant_matmul="pallas"))
    assert launches == [3]
    want = project_many(x, ws, xla)  # one project each, no launch
    assert launches == [3] and [g.shape for g in got] == [(1, 8, 256), (1, 8, 64), (1, 8, 64)]
    for g, w in zip(got, want, strict=True):  # bf16 outputs, sums in another order
        w = np.asarray(w, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=1e-2 * np.abs(w).max())


@pytest.mark.gpu
@pytest.mark.parametrize("bits, group", [(8, None), (4, 128)])
@pytest.mark.parametrize("scale_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rows", [1, 8, 13, 16])
def test_the_kernel_multiplies_as_dequantize_then_matmul_on_hopper(bits, group, scale_dtype, rows):
    """Compiled on an sm_90 GPU, against dequantize-then-matmul in float32 (``qw.reference``):
    every product exact, so only the order of the float32 sums differs; fresh inputs, back to
    back calls."""
    assert qw.device_supported(), "needs an sm_90 GPU"
    rng = np.random.default_rng(rows)
    w = random_weight(rng, 2048, 768, bits, group, scale_dtype)
    kw = qw.prepare(w)
    for _ in range(3):
        x = jnp.asarray(rng.standard_normal((rows, 2048)), jnp.bfloat16)
        got = np.asarray(qw.qmatmul(x, kw))
        want = np.asarray(qw.reference(x, w))
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("bits, group", [(8, None), (4, 128)])
@pytest.mark.parametrize("widths", [(1024, 256, 256), (768, 768)])
def test_weights_in_one_launch_multiply_as_each_alone_on_hopper(bits, group, widths):
    """q, k, v (or gate and up) in one launch: their columns side by side, each as its own."""
    assert qw.device_supported(), "needs an sm_90 GPU"
    rng = np.random.default_rng(len(widths))
    ws = [random_weight(rng, 2048, c, bits, group, jnp.bfloat16) for c in widths]
    x = jnp.asarray(rng.standard_normal((8, 2048)), jnp.bfloat16)
    got = np.asarray(qw.qmatmul(x, tuple(qw.prepare(w) for w in ws)))
    want = np.concatenate([np.asarray(qw.reference(x, w)) for w in ws], axis=1)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("bits, group, splits", [(4, 256, 4), (4, 256, None), (8, 256, None)])
def test_groups_of_several_k_steps_take_their_own_scales_on_hopper(bits, group, splits):
    """Groups that span K steps: 4 splits of 4 steps over int4 groups of 2 (each step's sum
    scaled), and the plan's one-step splits (scaled once a split)."""
    assert qw.device_supported(), "needs an sm_90 GPU"
    rng = np.random.default_rng(group + bits)
    w = random_weight(rng, 2048, 512, bits, group, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((8, 2048)), jnp.bfloat16)
    got = np.asarray(qw.qmatmul(x, qw.prepare(w), splits=splits))
    want = np.asarray(qw.reference(x, w))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
