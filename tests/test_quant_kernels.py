"""Quantized weights in the kernels (pallas_kernels/quant.py, quant_linear.py and fused_linear.py
over quantized weights) against dequantize-then-matmul, on fresh random inputs.

On CPU the kernels run through the Pallas interpreter, whose outputs start as NaN: an element a
kernel forgets to write shows up. Sizes are odd and tiles small, so every case has several column
tiles and K tiles, tiles that hang past the arrays' ends, and groups that straddle tiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fused_linear as fl
from pallas_kernels import quant
from pallas_kernels import quant_linear as ql

INTERPRET = jax.default_backend() != "gpu"
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}

FORMATS = {  # name -> (bits, group, mins)
    "int8-channel": (8, None, False),
    "int4-channel": (4, None, False),  # AWQ's group_size -1
    "q8_0": (8, 32, False),
    "int4": (4, 32, False),
    "q4_1": (4, 32, True),
    "int4-g64": (4, 64, True),
}


def random_weight(rng, k: int, n: int, fmt: str, dtype=jnp.float32) -> quant.QuantizedWeight:
    """Random codes, scales (float16, as GGUF stores them) and mins of one format (a name of
    ``FORMATS`` or its ``(bits, group, mins)``)."""
    bits, group, mins = FORMATS[fmt] if isinstance(fmt, str) else fmt
    group = group or k
    g = k // group
    scales = jnp.asarray(rng.uniform(0.005, 0.05, (g, n)), jnp.float16)
    if bits == 8:
        values = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
    else:
        values = quant.pack4(jnp.asarray(rng.integers(0, 16, (k, n)), jnp.uint8), group)
    low = jnp.asarray(rng.normal(0, 0.1, (g, n)), jnp.float16) if mins else None
    return quant.QuantizedWeight(values, scales, low, bits, group, jnp.dtype(dtype).name)


def _finite(got):
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any(), "an output element was never written"
    return got


def _close(got, want, dtype):
    got, want = _finite(got), np.asarray(want, np.float32)
    assert got.shape == want.shape
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL[dtype] * scale)


def test_pack_unpack_round_trip_and_the_gguf_nibble_order():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (96, 5)).astype(np.uint8)
    packed = quant.pack4(codes, 32)
    assert packed.shape == (48, 5) and packed.dtype == np.uint8
    np.testing.assert_array_equal(quant.unpack4(packed, 32), codes)
    np.testing.assert_array_equal(np.asarray(quant.unpack4(jnp.asarray(packed), 32)), codes)
    # GGUF's block: byte j holds element j (low nibble) and j + 16 (high nibble)
    assert packed[3, 2] == codes[3, 2] | (codes[19, 2] << 4)
    assert packed[16 + 3, 2] == codes[32 + 3, 2] | (codes[32 + 19, 2] << 4)
    assert quant.low_row(np.arange(16, 20), 32).tolist() == [32, 33, 34, 35]


@pytest.mark.parametrize("bits, group", [(8, None), (8, 32), (4, 32), (4, 128)])
def test_quantize_is_symmetric_and_close(bits, group):
    rng = np.random.default_rng(bits + (group or 0))
    w = jnp.asarray(rng.standard_normal((256, 40)), jnp.float32)
    qw = quant.quantize(w, bits, group)
    assert qw.shape == (256, 40) and qw.mins is None and qw.group == (group or 256)
    err = np.abs(np.asarray(quant.dequantize(qw)) - np.asarray(w))
    step = np.repeat(np.asarray(qw.scales), qw.group, axis=0)
    assert (err <= 0.5 * step + 1e-6).all()  # round to nearest: half a step at most
    # a zero group stays zero
    z = quant.quantize(jnp.zeros((64, 3)), bits, 32)
    assert not np.asarray(quant.dequantize(z)).any()


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="does not divide"):
        quant.quantize(jnp.zeros((100, 4)), 4, 64)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        quant.quantize(jnp.zeros((64, 4)), 3, 32)
    with pytest.raises(ValueError, match="scales"):
        quant.QuantizedWeight(
            jnp.zeros((64, 4), jnp.int8), jnp.zeros((3, 4)), None, 8, 32, "float32"
        )


CASES = [  # (rows, K, N, bn, bk, splits): K tiles past K's end, splits of unequal length
    (1, 192, 72, 32, 128, None),
    (3, 320, 40, 16, 64, 2),
    (16, 128, 50, 32, 32, 1),
]


def _qmatmul_cases():
    """Every (case, format, dtype); the default run takes a third of them, each (format, dtype)
    once, each case three or four times, the rest slow."""
    out = []
    for i, case in enumerate(CASES):
        for j, fmt in enumerate(sorted(FORMATS)):
            for d, dtype in enumerate((jnp.float32, jnp.bfloat16)):
                marks = () if (i + j + d) % len(CASES) == 0 else (pytest.mark.slow,)
                out.append(pytest.param(*case, fmt, dtype, marks=marks))
    return out


@pytest.mark.parametrize("m, k, n, bn, bk, splits, fmt, dtype", _qmatmul_cases())
def test_qmatmul_equals_dequantize_then_matmul(m, k, n, bn, bk, splits, fmt, dtype):
    rng = np.random.default_rng(m * 1000 + k + n)
    w = random_weight(rng, k, n, fmt, dtype)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    got = ql.qmatmul(x, w, interpret=INTERPRET, bn=bn, bk=bk, splits=splits)
    assert got.dtype == jnp.float32 and got.shape[1:] == (m, n)
    _close(jnp.sum(got, axis=0), ql.qmatmul_reference(x, w), dtype)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_in_kernel_dequantization_is_bit_exact(fmt):
    """One-hot rows pick single rows of the weight: every output is one product 1 * w plus
    zeros, so no order of sums can differ and the kernel's values must be the reference's."""
    rng = np.random.default_rng(5)
    k, n = 128, 40
    w = random_weight(rng, k, n, fmt)
    pick = rng.choice(k, 16, replace=False)
    x = jnp.asarray(np.eye(k, dtype=np.float32)[pick])
    got = _finite(jnp.sum(ql.qmatmul(x, w, interpret=INTERPRET, bn=16, bk=32), axis=0))
    np.testing.assert_array_equal(got, np.asarray(quant.dequantize(w))[pick])


@pytest.mark.parametrize("bits, group, bk", [(8, 48, 64), (4, 96, 128)])
def test_groups_of_no_power_of_two_take_a_scale_row_per_run(bits, group, bk):
    """Tiles of 64 (128) rows cut groups of 48 (96) in the middle: the kernel takes a scale row
    for each run of 16 (32) rows, the largest power of two dividing the group. Rows of the
    identity pick the weight's rows one at a time, so the whole dequantized weight must come
    out to the bit."""
    rng = np.random.default_rng(bits)
    k, n = 288, 40
    w = random_weight(rng, k, n, (bits, group, bits == 4))
    eye = np.eye(k, dtype=np.float32)
    got = np.concatenate([
        _finite(jnp.sum(ql.qmatmul(jnp.asarray(eye[i : i + 16]), w, interpret=INTERPRET, bn=16,
                                   bk=bk), axis=0))
        for i in range(0, k, 16)
    ])  # fmt: skip
    np.testing.assert_array_equal(got, np.asarray(quant.dequantize(w)))


def test_norm_project_stores_the_residual_beside_4bit_tiles_of_whole_groups():
    """A 4-bit weight in groups of whole tiles hands the norm its low and high rows as two runs
    of bk / 2 columns, neither of which is the split's own columns: the settled residual is
    still stored, once, for the split's columns."""
    rng = np.random.default_rng(7)
    m, k = 2, 128
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    g = jnp.asarray(rng.random(k), jnp.float32)
    pending = jnp.asarray(rng.standard_normal((2, m, k)), jnp.float32)
    ws = (random_weight(rng, k, 24, "int4-g64"),)
    settled, part = fl.norm_project(x, pending, g, ws, eps=1e-5, interpret=INTERPRET, bn=16,
                                    bk=64)  # fmt: skip
    want_x, want = fl.norm_project_reference(x, pending, g, ws, eps=1e-5)
    np.testing.assert_array_equal(np.asarray(settled), np.asarray(want_x))
    _close(jnp.sum(part, axis=0), want[0], jnp.float32)


def test_qmatmul_refuses_what_it_cannot_take():
    w = random_weight(np.random.default_rng(0), 64, 16, "int4")
    assert "rows" in ql.unsupported_reason(jnp.zeros((17, 64)), w)
    assert "bfloat16" in ql.unsupported_reason(jnp.zeros((2, 64), jnp.bfloat16), w)
    assert "shape" in ql.unsupported_reason(jnp.zeros((2, 32)), w)
    assert ql.unsupported_reason(jnp.zeros((2, 64)), w) is None
    with pytest.raises(ValueError, match="bk >= 32"):
        ql.qmatmul(jnp.zeros((2, 64)), w, interpret=True, bk=16)
    assert ql.plan(4096, 4096, 64, 256, None) == (4, 4)  # 64 column tiles, 4 K splits
    assert ql.plan(4096, 14336, 64, 256, None) == (1, 16)


@pytest.mark.parametrize(
    "fmts, dtype",
    [
        (("q4_1", "int8-channel"), jnp.bfloat16),
        (("int4", "q8_0"), jnp.float32),
        pytest.param(("q4_1", "int8-channel"), jnp.float32, marks=pytest.mark.slow),
        pytest.param(("int4", "q8_0"), jnp.bfloat16, marks=pytest.mark.slow),
    ],
)  # the default run: each format and each dtype once
def test_split_k_projection_kernels_take_quantized_weights(fmts, dtype):
    """The fused projection kernels (norm + Q/K/V, o_proj over attention splits, SiLU + down)
    over quantized weights, some side by side with a dense one, against their references
    (which dequantize first). K = 96 in tiles of 64: the second tile hangs past K (its 4-bit
    codes' rows past the end are masked)."""
    rng = np.random.default_rng(len(fmts[0]))
    m, k, f = 3, 96, 64
    tile = dict(interpret=INTERPRET, bn=16, bk=64)
    x, g = jnp.asarray(rng.standard_normal((m, k)), dtype), jnp.asarray(rng.random(k), dtype)
    ws = (random_weight(rng, k, 48, fmts[0], dtype), random_weight(rng, k, 24, fmts[1], dtype))
    ws += (jnp.asarray(rng.standard_normal((k, 40)) * 0.2, dtype),)
    pending = jnp.asarray(rng.standard_normal((3, m, k)), jnp.float32)
    settled, part = fl.norm_project(x, pending, g, ws, eps=1e-5, **tile)
    want_x, want = fl.norm_project_reference(x, pending, g, ws, eps=1e-5)
    np.testing.assert_array_equal(np.asarray(settled), np.asarray(want_x))
    _close(jnp.sum(part, axis=0), jnp.concatenate(want, axis=1), dtype)
    a = jnp.asarray(rng.standard_normal((m, k)), dtype)
    want = jnp.concatenate([fl._mm(a, w) for w in ws], axis=1)
    _close(jnp.sum(fl.project(a, ws, **tile), axis=0), want, dtype)
    gate_up = jnp.asarray(rng.standard_normal((2, m, 2 * f)), jnp.float32)
    wd = random_weight(rng, f, k, fmts[0], dtype)
    got = fl.silu_project(gate_up, wd, **tile)
    _close(jnp.sum(got, axis=0), fl.silu_project_reference(gate_up, wd, dtype), dtype)
    b, t, kh, grp, splits, hd = 1, 3, 2, 2, 3, 32
    acc = jnp.asarray(rng.normal(size=(b, kh, splits, 16, hd)), jnp.float32)
    mx = jnp.asarray(3 * rng.normal(size=(b, kh, splits, 16)), jnp.float32)
    ssum = jnp.asarray(rng.uniform(0.5, 2.0, size=(b, kh, splits, 16)), jnp.float32)
    wo = random_weight(rng, kh * grp * hd, 40, fmts[1], dtype)
    got = fl.combine_project(acc, mx, ssum, wo, t=t, **tile)
    _close(jnp.sum(got, axis=0), fl.combine_project_reference(acc, mx, ssum, wo, t=t), dtype)
