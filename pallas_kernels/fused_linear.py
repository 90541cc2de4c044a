"""Fused small-row projections for decoding (issue 10): one kernel for RMSNorm + Q/K/V + RoPE, one
for RMSNorm + gate/up + SiLU*mul, one for a projection + residual add.

Why: at batch 1 a small model is bound by the number and fixed cost of its kernels, not by bytes
(SmolLM2-135M's 270 MB of weights take ~0.06 ms to read, its XLA decode step ~1.06 ms for 491
kernels on an H200, ~2.3 us each; benchmarks/notes/small_model.md). XLA turns one decoder layer
into ~16 kernels: the norm, Q, K, V, RoPE, the row padding GEMMs want, gate, up, SiLU*mul, down
and the residual adds each launch. These kernels do a layer's projections in three launches
(attention and the cache writes stay as they are).

Contract: rows ``x [M, K]`` (``M = batch * tokens``, at most ``MAX_ROWS``), weights ``[K, N]`` as
the model stores them (``y = x @ w``), results in ``x.dtype``. Rounding happens where the plain
path (``jaxspec.model``) rounds: the normalised row is cast to the dtype before the norm weight
scales it, each projection is rounded before RoPE / SiLU / the residual add; sums run in float32.
Only the summation order differs from XLA's GEMM, so float32 results agree to ~1e-6.

Layout (Pallas, Triton lowering): a 1-D grid over column tiles of ``bn`` columns; program ``j``
reads its ``[K, bn]`` weight tile in power-of-two row chunks (Triton wants power-of-two shapes;
K = 576 = 512 + 64), multiplies the M rows, placed in a zero ``[16, chunk]`` tile inside the
kernel (Triton's smallest dot; no padding kernel outside), into each chunk on the tensor cores,
and writes ``[M, bn]``. RoPE
needs both halves of a head, so the Q/K/V kernel's program reads the column tile at ``c`` and at
``c + head_dim / 2`` and rotates them together. Every weight byte is read once per call.

Measured on one H200 (``benchmarks/gpu/probe_small.py``, SmolLM2 shape, batch 1, context 1024):
the step went from 491 kernels to 342, but from 1.05 ms to 1.35 ms. Each fused kernel took
8.5-8.8 us (the o_proj one 4.7 us), whatever the chunk size (256 or 1024 rows), warp count (4
or 8) or product (CUDA-core sums or tensor-core dots). The time follows the bytes each program
reads: o_proj (576 weight rows a program) 4.7 us, down (1536) 8.8 us, so ~7 GB/s per program at
the margin. That is what one SM gets with few loads in flight, and the grids are small (30-96
programs on 132 SMs). The likely fix, not yet tried: more programs per weight, splitting K
with float32 partial sums merged in the epilogue, as the decode-attention kernel splits its
keys. Until then the model leaves these kernels off (``JAXSPEC_FUSED_LINEAR``, see
``jaxspec.model``).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

MAX_ROWS = 16  # more rows: XLA's GEMMs win, the dispatcher falls back
ROWS = 16  # rows of the tensor-core tile (Triton's smallest dot); rows past M are zeros
# Rows of a weight tile loaded at once (register pressure; 256 and 1024 measured the same on the
# H200, see the module docstring).
MAX_CHUNK = int(os.environ.get("JAXSPEC_FUSED_CHUNK", "1024"))
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _chunks(k: int) -> list[tuple[int, int]]:
    """``[0, k)`` cut into power-of-two pieces of at most MAX_CHUNK: (offset, size)."""
    out, off = [], 0
    while off < k:
        size = min(MAX_CHUNK, 1 << ((k - off).bit_length() - 1))
        out.append((off, size))
        off += size
    return out


def _tile(n: int, want: int) -> int:
    """Column tile: the largest power of two <= ``want`` that divides ``n`` (>= 16 where
    ``unsupported_reason`` passed)."""
    bn = want
    while bn > 1 and n % bn:
        bn //= 2
    return bn


def unsupported_reason(x, *weights, head_dim: int | None = None) -> str | None:
    """Why these kernels cannot take these arrays (``None`` when they can). Triton's dot wants
    tiles of at least 16 x 16: K, the weight widths and half a head are multiples of 16."""
    if x.ndim != 2:
        return f"rows must be [M, K], got {x.shape}"
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        return f"{m} rows not in [1, {MAX_ROWS}]"
    if k % 16:
        return f"row width {k} not a multiple of 16"
    if head_dim is not None and (head_dim // 2) % 16:
        return f"head_dim {head_dim}: half a head is not a multiple of 16"
    dts = {jnp.dtype(a.dtype) for a in (x, *weights)}
    if len(dts) != 1 or next(iter(dts)) not in SUPPORTED_DTYPES:
        return f"dtypes {sorted(str(d) for d in dts)} (need one of bf16/f16/f32 for all)"
    for w in weights:
        if w.ndim != 2 or w.shape[0] != k:
            return f"weight {w.shape} does not take rows of width {k}"
        if w.shape[1] % 16:
            return f"weight width {w.shape[1]} not a multiple of 16"
    return None


# ---- the pure-jnp references (the plain path's arithmetic) ----------------------------------


def rms(x, g, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return g * xf.astype(x.dtype)


def _mm(x, w):
    return jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)


def _rope(x, cos, sin, hd):
    m = x.shape[0]
    xf = x.reshape(m, -1, hd).astype(jnp.float32)
    x1, x2 = xf[..., : hd // 2], xf[..., hd // 2 :]
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.reshape(m, -1).astype(x.dtype)


def qkv_rope_reference(x, g, wq, wk, wv, cos, sin, *, eps: float, head_dim: int):
    """``rope(n @ wq), rope(n @ wk), n @ wv`` with ``n = rmsnorm(x) * g``; cos/sin ``[M, hd/2]``."""
    n = rms(x, g, eps)
    return _rope(_mm(n, wq), cos, sin, head_dim), _rope(_mm(n, wk), cos, sin, head_dim), _mm(n, wv)


def gate_up_reference(x, g, wg, wu, *, eps: float):
    """``silu(n @ wg) * (n @ wu)`` with ``n = rmsnorm(x) * g``."""
    n = rms(x, g, eps)
    return jax.nn.silu(_mm(n, wg)) * _mm(n, wu)


def matmul_add_reference(x, w, r):
    """``r + x @ w``."""
    return r + _mm(x, w)


# ---- kernels -----------------------------------------------------------------------------------


def _rows(x_ref, g_ref, m: int, k: int, eps: float | None):
    """Per chunk of K: the M rows as a ``[ROWS, size]`` tile (rows past M are zero), normalised
    and scaled when ``eps`` is given, rounded to the input dtype where the plain path rounds."""
    dt = x_ref.dtype
    chunks = _chunks(k)
    tiles = []
    for off, size in chunks:
        row = jax.lax.broadcasted_iota(jnp.int32, (ROWS, size), 0)
        t = jnp.zeros((ROWS, size), jnp.float32)
        for r in range(m):
            t = jnp.where(row == r, x_ref[r, pl.ds(off, size)].astype(jnp.float32)[None, :], t)
        tiles.append(t)
    if eps is not None:
        ss = sum(jnp.sum(t * t, axis=1) for t in tiles)
        inv = jax.lax.rsqrt(ss / k + eps)[:, None]
        tiles = [
            _round(g_ref[pl.ds(off, size)].astype(jnp.float32)[None, :] * _round(t * inv, dt), dt)
            for t, (off, size) in zip(tiles, chunks, strict=True)
        ]
    return [t.astype(dt) for t in tiles]


def _gemv(tiles, w_ref, col, bn: int, k: int, m: int):
    """Per row: ``row @ w[:, col:col+bn]`` in float32, from one tensor-core product per chunk
    (rows padded to ROWS inside the kernel; the weight tile is read once)."""
    acc = jnp.zeros((ROWS, bn), jnp.float32)
    for t, (off, size) in zip(tiles, _chunks(k), strict=True):
        w = w_ref[pl.ds(off, size), pl.ds(col, bn)]
        acc = acc + jax.lax.dot_general(
            t,
            w,
            (((1,), (0,)), ((), ())),
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
    row = jax.lax.broadcasted_iota(jnp.int32, (ROWS, bn), 0)
    return [jnp.sum(jnp.where(row == r, acc, 0.0), axis=0) for r in range(m)]


def _round(v, dt):
    return v.astype(dt).astype(jnp.float32)


def _qkv_kernel(
    x_ref, g_ref, wq_ref, wk_ref, wv_ref, cos_ref, sin_ref, q_ref, k_ref, v_ref, *, m, k, eps, hd,
    bn, nq, nk
):  # fmt: skip
    half = hd // 2
    per_head = half // bn
    pid = pl.program_id(0)
    head, sub = pid // per_head, pid % per_head
    dt = x_ref.dtype
    rows = _rows(x_ref, g_ref, m, k, eps)

    def rotated(w_ref, out_ref, h):
        c1 = h * hd + sub * bn
        a = _gemv(rows, w_ref, c1, bn, k, m)
        b = _gemv(rows, w_ref, c1 + half, bn, k, m)
        for r in range(m):
            cs = cos_ref[r, pl.ds(sub * bn, bn)]
            sn = sin_ref[r, pl.ds(sub * bn, bn)]
            ar, br = _round(a[r], dt), _round(b[r], dt)
            out_ref[r, pl.ds(c1, bn)] = (ar * cs - br * sn).astype(dt)
            out_ref[r, pl.ds(c1 + half, bn)] = (br * cs + ar * sn).astype(dt)

    def plain(w_ref, out_ref, h):
        c1 = h * hd + sub * bn
        a = _gemv(rows, w_ref, c1, bn, k, m)
        b = _gemv(rows, w_ref, c1 + half, bn, k, m)
        for r in range(m):
            out_ref[r, pl.ds(c1, bn)] = a[r].astype(dt)
            out_ref[r, pl.ds(c1 + half, bn)] = b[r].astype(dt)

    @pl.when(head < nq)
    def _():
        rotated(wq_ref, q_ref, head)

    @pl.when((head >= nq) & (head < nq + nk))
    def _():
        rotated(wk_ref, k_ref, head - nq)

    @pl.when(head >= nq + nk)
    def _():
        plain(wv_ref, v_ref, head - nq - nk)


def _gate_up_kernel(x_ref, g_ref, wg_ref, wu_ref, o_ref, *, m, k, eps, bn):
    col = pl.program_id(0) * bn
    dt = x_ref.dtype
    rows = _rows(x_ref, g_ref, m, k, eps)
    gate = _gemv(rows, wg_ref, col, bn, k, m)
    up = _gemv(rows, wu_ref, col, bn, k, m)
    for r in range(m):
        gr = _round(gate[r], dt)
        # XLA keeps silu(gate) * up in float32 inside its fusion (excess precision allowed)
        act = gr * jax.nn.sigmoid(gr)
        o_ref[r, pl.ds(col, bn)] = (act * _round(up[r], dt)).astype(dt)


def _matmul_add_kernel(x_ref, w_ref, r_ref, o_ref, *, m, k, bn):
    col = pl.program_id(0) * bn
    dt = x_ref.dtype
    rows = _rows(x_ref, None, m, k, None)
    acc = _gemv(rows, w_ref, col, bn, k, m)
    for r in range(m):
        res = r_ref[r, pl.ds(col, bn)].astype(jnp.float32)
        o_ref[r, pl.ds(col, bn)] = (res + _round(acc[r], dt)).astype(dt)


NUM_WARPS = int(os.environ.get("JAXSPEC_FUSED_WARPS", "4"))


def _call(kernel, grid, out_shape, args, interpret, num_warps=NUM_WARPS):
    return pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(*args)


@functools.partial(jax.jit, static_argnames=("eps", "head_dim", "interpret", "bn"))
def qkv_rope(
    x: Float[Array, "m k"],
    g: Float[Array, " k"],
    wq: Float[Array, "k nq"],
    wk: Float[Array, "k nk"],
    wv: Float[Array, "k nk"],
    cos: Float[Array, "m half"],
    sin: Float[Array, "m half"],
    *,
    eps: float,
    head_dim: int,
    interpret: bool = False,
    bn: int = 16,
):
    """The kernel version of :func:`qkv_rope_reference`: ``(q, k, v)`` rows in ``x.dtype``."""
    m, k = x.shape
    bn = _tile(head_dim // 2, bn)
    nq, nk = wq.shape[1] // head_dim, wk.shape[1] // head_dim
    grid = ((nq + 2 * nk) * (head_dim // 2 // bn),)
    kern = functools.partial(_qkv_kernel, m=m, k=k, eps=eps, hd=head_dim, bn=bn, nq=nq, nk=nk)
    shapes = [jax.ShapeDtypeStruct((m, w.shape[1]), x.dtype) for w in (wq, wk, wv)]
    args = (x, g, wq, wk, wv, cos.astype(jnp.float32), sin.astype(jnp.float32))
    return tuple(_call(kern, grid, shapes, args, interpret))


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "bn"))
def gate_up(
    x: Float[Array, "m k"],
    g: Float[Array, " k"],
    wg: Float[Array, "k f"],
    wu: Float[Array, "k f"],
    *,
    eps: float,
    interpret: bool = False,
    bn: int = 16,
) -> Float[Array, "m f"]:
    """The kernel version of :func:`gate_up_reference`."""
    m, k = x.shape
    bn = _tile(wg.shape[1], bn)
    kern = functools.partial(_gate_up_kernel, m=m, k=k, eps=eps, bn=bn)
    shape = jax.ShapeDtypeStruct((m, wg.shape[1]), x.dtype)
    return _call(kern, (wg.shape[1] // bn,), shape, (x, g, wg, wu), interpret)


@functools.partial(jax.jit, static_argnames=("interpret", "bn"))
def matmul_add(
    x: Float[Array, "m k"],
    w: Float[Array, "k n"],
    r: Float[Array, "m n"],
    *,
    interpret: bool = False,
    bn: int = 16,
) -> Float[Array, "m n"]:
    """The kernel version of :func:`matmul_add_reference`."""
    m, k = x.shape
    bn = _tile(w.shape[1], bn)
    kern = functools.partial(_matmul_add_kernel, m=m, k=k, bn=bn)
    shape = jax.ShapeDtypeStruct((m, w.shape[1]), x.dtype)
    return _call(kern, (w.shape[1] // bn,), shape, (x, w, r), interpret)
