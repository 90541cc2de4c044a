"""Split-K projections for decode and verify steps (issue 10): a layer's four projections in four
kernels, each of which also does the elementwise work around it, and hands the next one float32
partial sums instead of a finished product.

Why: at batch 1 a small model is bound by the number of its kernels, not by its bytes. On the
H200 SmolLM2-135M's step is ~341 kernels of ~2.4 us, 11 a layer: the norm, the Q/K/V GEMM, its
split-K sum, the attention kernel, its combine, o_proj, the residual add, the second norm,
gate/up, SiLU * up and down (git show 785ba73:benchmarks/notes/small_step_probe_s9.md). XLA
splits K to fill the GPU and sums the splits in a kernel of its own. Here the consumer sums them:

- ``norm_project(x, pending, g, ws)``: ``x + round(sum(pending))`` (the residual add of the
  previous projection), RMSNorm, then ``[n @ w for w in ws]`` as partials. Q/K/V and gate/up.
- ``combine_project(acc, m, ssum, w)``: o_proj that merges the attention kernel's split-K
  results by log-sum-exp as it loads them (``rope_attention.Splits``), as partials.
- ``project(a, ws)``: ``a @ w`` as partials (o_proj after an attention that merged its own
  splits: a draft's tree expansion).
- ``silu_project(gate_up, w)``: ``silu(round(sum gate)) * round(sum up)``, then ``@ w`` as
  partials (down).

The Q/K/V partials go to ``rope_attention``, which sums them as it loads its heads; the caller
sums the last down's. A decode layer is five kernels (four projections, the attention), not 11;
a verify block's, eight (``norm_then_project``, o_proj after the attention merged its splits).

The earlier version of this file (one kernel a projection, no split-K, ``[K, 16]`` weight tiles)
took 8.5-8.8 us a kernel on the H200: 30-96 programs each reading a narrow column strip, ~7 GB/s
per program (benchmarks/notes/small_step_probe.md). Here program ``(j, s)`` of the grid
``(column tiles, K splits)`` reads one ``[BK, BN]`` tile (``BN`` = 64 bf16 columns: one 128-byte
line a row; ``BK`` = 128), so a SmolLM2 projection has 45-240 programs whose loads all issue at
once.

The norm needs the whole row, so every program of a norm kernel sums the whole row's pending
partials: cheap for a small model (SmolLM2: 27 KiB from L2 a program), not for a 1B one
(``layer_problem``: the model takes the plain path there).

The tiling (``bn``, ``bk``, ``num_warps``) is each call's static argument; the model takes it from
its ``KernelConfig.linear_tile`` (GPU default 64 x 128 x 4, the fastest of six tilings on an
H200, and Q/K/V's own ``bk`` 256: fewer partials for the attention kernel; results/qkv_split.json).

Contract: rows ``[M, K]`` (``M = batch * tokens``, at most ``MAX_ROWS``), weights ``[K, N]`` as the
model stores them (``y = x @ w``), partials ``[S, M, sum N]`` float32 with ``S = ceil(K / BK)``,
the weights' columns side by side. Rounding happens where the plain path
(``jaxspec.model.transformer``) rounds: each projection's sum is rounded to the input dtype before
the residual add or SiLU, the normalised row before the norm weight scales it. Products are exact in
float32 and summed in float32, so only the summation order differs from XLA's GEMM (float32 results
agree to ~1e-6). Rows and columns past the arrays' ends are masked, so any M, K and N work.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from pallas_kernels import quant
from pallas_kernels.decode_attention import combine
from pallas_kernels.quant import QuantizedWeight
from pallas_kernels.quant_linear import (
    check_tiles,
    compute_dtype,
    load_cols,
    operands,
    regroup,
    rows_of,
    tile_dot,
    weight_tiles,
)
from pallas_kernels.quant_wgmma import KMajorWeight

MAX_ROWS = 16  # more rows: XLA's GEMMs win, the model takes the plain path
BN = 64  # columns a program (a power of two): one 128-byte line of bf16 a row
BK = 128  # rows of the weight a program (its K split)
# Every program of a norm kernel sums the whole row's pending partials (the norm needs the whole
# row): ``parts * width * 4`` bytes from L2 a program. Past this the redundancy costs more than
# the kernel it saves, and the model takes the plain path (Llama-3.2-1B: 64 down partials of
# 2048 floats, 512 KiB; SmolLM2-135M: 12 of 576, 27 KiB).
MAX_PENDING_BYTES = 64 * 1024
NUM_WARPS = 4
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def n_splits(k: int, bk: int | None = None) -> int:
    """Partial sums a projection over rows of width ``k`` hands on."""
    return math.ceil(k / (bk or BK))


def unsupported_reason(x, *weights) -> str | None:
    """Why these kernels cannot take these arrays (``None`` when they can)."""
    if x.ndim != 2:
        return f"rows must be [M, K], got {x.shape}"
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        return f"{m} rows not in [1, {MAX_ROWS}]"
    dts = {jnp.dtype(x.dtype)} | {compute_dtype(w) for w in weights}
    if len(dts) != 1 or next(iter(dts)) not in SUPPORTED_DTYPES:
        return f"dtypes {sorted(str(d) for d in dts)} (need one of bf16/f16/f32 for all)"
    for w in weights:
        if isinstance(w, KMajorWeight):
            return "a K-major quantized weight (quant_wgmma's layout)"
        if len(w.shape) != 2 or w.shape[0] != k:
            return f"weight {w.shape} does not take rows of width {k}"
    return None


def layer_problem(hidden: int, attn_width: int, intermediate: int, bk: int | None = None):
    """Why a decoder layer of these sizes should not take the kernels (``None``: it should):
    the norm kernels' redundant reads of the pending partials (``MAX_PENDING_BYTES``)."""
    need, name = max((n_splits(k, bk) * hidden * 4, name) for name, k in (
        ("o_proj", attn_width), ("down", intermediate)
    ))  # fmt: skip
    if need > MAX_PENDING_BYTES:
        return f"each norm program would read {need} bytes of {name}'s partials"
    return None


# ---- the pure-jnp references (the plain path's arithmetic) ----------------------------------


def rms(x, g, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return g * xf.astype(x.dtype)


def _mm(x, w):
    """``x @ w`` as the plain path computes it; a quantized ``w`` dequantized first."""
    if quant.is_quantized(w):
        w = quant.dequantize(w, x.dtype)
    return jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)


def settle(x, pending):
    """``x + round(sum(pending))``: the residual add of a projection handed on as partials (the
    identity when ``pending`` is None)."""
    if pending is None:
        return x
    total = pending[0]
    for p in pending[1:]:  # in order, as the kernels sum them: a reduce's order is XLA's choice
        total = total + p  # (on the H200 ``jnp.sum`` over 3 partials differed in the last bit)
    return x + total.astype(x.dtype)


def norm_project_reference(x, pending, g, ws, *, eps: float):
    """``(x', [n @ w for w in ws])`` with ``x' = settle(x, pending)``, ``n = rmsnorm(x') * g``."""
    x = settle(x, pending)
    n = rms(x, g, eps)
    return x, [_mm(n, w) for w in ws]


def norm_then_project(x, pending, g, ws, *, eps: float, **tiles):
    """:func:`norm_project` for several rows (a verify): the settle and norm once (XLA), then
    :func:`project`, not in every program (SmolLM2 at 16 rows: 442 KiB of partials each)."""
    x = settle(x, pending)
    return x, project(rms(x, g, eps), ws, **tiles)


def combine_project_reference(acc, m, ssum, w, *, t: int):
    """``combine(splits) @ w``: the attention output merged from its splits by log-sum-exp
    (``decode_attention.combine``), as ``[B * T, H * hd]`` rows, times ``w``."""
    rows = t * (w.shape[0] // acc.shape[-1] // acc.shape[1])
    out = combine(acc[..., :rows, :], m[..., :rows], ssum[..., :rows], t, compute_dtype(w))
    return _mm(out.reshape(-1, w.shape[0]), w)


def silu_project_reference(gate_up, w, dtype):
    """``(silu(gate) * up) @ w`` with gate / up the rounded sums of the partials' two halves."""
    f = gate_up.shape[-1] // 2
    s = jnp.sum(gate_up, axis=0).astype(dtype)
    return _mm(jax.nn.silu(s[:, :f]) * s[:, f:], w)


# ---- kernels -----------------------------------------------------------------------------------


def _round(v, dt):
    return v.astype(dt).astype(jnp.float32)


def _shift(cols, d: int):
    """``cols`` (``load_cols``' columns) moved right by ``d``."""
    return (cols[0] + d, cols[1]) if isinstance(cols, tuple) else cols + d


def _summed(ref, parts: int, rows: int, m: int, cols, limit: int, dt):
    """The rounded sum of ``parts`` partials' ``[:rows, cols]`` (summed in order)."""
    total = load_cols(ref, rows, m, cols, limit, 0)
    for s in range(1, parts):
        total = total + load_cols(ref, rows, m, cols, limit, s)
    return _round(total, dt)


def _project(prologue, weights, widths, o_ref, *, k0, kdim: int, m: int, bn: int, bk: int, rows,
             dt):  # fmt: skip
    """Program ``(j, s)``: the rows' K split ``s`` times the weight tile of column tile ``j``,
    stored as partial ``s``. ``prologue(*cols)`` gives the rows' activations (float32 holding
    values of ``dt``) at the rows of K each weight tile holds (``weight_tiles``: one tile, or a
    4-bit weight's two). Column tiles run over the weights side by side; the branch that owns
    tile ``j`` runs. The weight tile is loaded before the prologue's loads, so the two round
    trips to memory overlap (a warp stalls at the first use of a load, not at the load)."""
    j, s = pl.program_id(0), pl.program_id(1)
    first, out0 = 0, 0
    for w, n in zip(weights, widths, strict=True):
        tiles = -(-n // bn)

        @pl.when((j >= first) & (j < first + tiles))
        def _(w=w, n=n, first=first, out0=out0):
            c = pl.multiple_of((j - first) * bn, bn)
            pairs = weight_tiles(w, k0, bk, c, bn, kdim, n, dt)
            acts = prologue(*(cols for cols, _ in pairs))
            acc = tile_dot(acts[0], pairs[0][1], rows)
            for a, (_, tile) in zip(acts[1:], pairs[1:], strict=True):
                acc = acc + tile_dot(a, tile, rows)
            live = (jnp.arange(rows) < m)[:, None] & ((c + jnp.arange(bn)) < n)[None, :]
            plgpu.store(o_ref.at[s, pl.ds(0, rows), pl.ds(out0 + c, bn)], acc, mask=live)

        first, out0 = first + tiles, out0 + n


def _norm_kernel(*refs, specs, parts, widths, m, k, eps, bn, bk, rows, dt):
    x_ref, *rest = refs
    p_ref = rest.pop(0) if parts else None
    g_ref, *rest = rest
    weights, (o_ref, xo_ref) = regroup(rest[:-2], specs), rest[-2:]
    k0 = pl.multiple_of(pl.program_id(1) * bk, bk)
    # one column tile writes the settled residual (program ids are read outside the branches:
    # the interpreter substitutes them at the kernel's top level only)
    writer = pl.program_id(0) == 0

    def g_of(cols):  # the norm weight at the columns ``cols``: [1, width] float32
        if isinstance(cols, tuple):
            ok = (cols[0] + jnp.arange(cols[1])) < k
            g = plgpu.load(g_ref.at[pl.ds(*cols)], mask=ok, other=0.0)
        else:
            ok = cols < k
            g = plgpu.load(g_ref.at[jnp.where(ok, cols, 0)], mask=ok, other=0.0)
        return g.astype(jnp.float32)[None, :]

    def settled(cols):  # x + round(sum(pending)) over the columns ``cols``
        x = load_cols(x_ref, rows, m, cols, k)
        return x if not parts else _round(x + _summed(p_ref, parts, rows, m, cols, k, dt), dt)

    def store(x):  # the settled residual of this split's columns, by one column tile
        live = (jnp.arange(rows) < m)[:, None] & ((k0 + jnp.arange(bk)) < k)[None, :]
        plgpu.store(xo_ref.at[pl.ds(0, rows), pl.ds(k0, bk)], x.astype(dt), mask=live & writer)

    def in_order(cols):  # the split's columns in order, (k0, bk): a dense or 8-bit weight's
        return isinstance(cols, tuple) and cols[1] == bk

    def prologue(*cols):
        # the norm's sum of squares over the whole row: one load of it for one row; for more,
        # spans of bk columns, so [rows, width] float32 never has to sit in registers at once
        span = _pow2(k) if rows == 1 else bk
        total = 0.0
        for c0 in range(0, k, span):
            # a span past the row's end as column indices (a static slice may not overrun)
            part = settled((c0, span) if c0 == 0 or c0 + span <= k else c0 + jnp.arange(span))
            total = total + jnp.sum(part * part, axis=1, keepdims=True)
        inv = jax.lax.rsqrt(total / k + eps)
        out = []
        for cs in cols:
            x = settled(cs)  # these columns (the same arithmetic, so the same values)
            if in_order(cs):
                store(x)
            out.append(_round(g_of(cs) * _round(x * inv, dt), dt))
        if not any(in_order(cs) for cs in cols):  # a 4-bit weight's two halves of other rows
            store(settled((k0, bk)))
        return out

    _project(prologue, weights, widths, o_ref, k0=k0, kdim=k, m=m, bn=bn, bk=bk, rows=rows, dt=dt)


def _plain_kernel(a_ref, *refs, specs, widths, m, k, bn, bk, rows, dt):
    weights, o_ref = regroup(refs[:-1], specs), refs[-1]
    k0 = pl.multiple_of(pl.program_id(1) * bk, bk)

    def prologue(*cols):
        return [load_cols(a_ref, rows, m, cs, k) for cs in cols]

    _project(prologue, weights, widths, o_ref, k0=k0, kdim=k, m=m, bn=bn, bk=bk, rows=rows, dt=dt)


def _silu_kernel(p_ref, *refs, specs, parts, widths, m, k, bn, bk, rows, dt):
    weights, o_ref = regroup(refs[:-1], specs), refs[-1]
    k0 = pl.multiple_of(pl.program_id(1) * bk, bk)

    def prologue(*cols):
        out = []
        for cs in cols:
            gate = _summed(p_ref, parts, rows, m, cs, k, dt)
            up = _summed(p_ref, parts, rows, m, _shift(cs, k), 2 * k, dt)
            # XLA keeps silu(gate) * up in float32 inside its fusion (excess precision), then
            # rounds
            out.append(_round(gate * jax.nn.sigmoid(gate) * up, dt))
        return out

    _project(prologue, weights, widths, o_ref, k0=k0, kdim=k, m=m, bn=bn, bk=bk, rows=rows, dt=dt)


def _combine_kernel(acc_ref, m_ref, ssum_ref, *refs, specs, n_splits, t, g, hd, widths, m, k,
                    bn, bk, rows, dt):  # fmt: skip
    weights, o_ref = regroup(refs[:-1], specs), refs[-1]
    k0 = pl.multiple_of(pl.program_id(1) * bk, bk)

    def merged(cols):
        # row r is token (r // t, r % t); column c is head c // hd, lane c % hd; that head's
        # results sit at KV head head // g, row (r % t) * g + head % g of the kernel's layout
        if isinstance(cols, tuple):
            cols = cols[0] + jnp.arange(cols[1])
        width = cols.shape[0]
        r = jnp.arange(rows)[:, None]
        c = cols[None, :]
        ok = (r < m) & (c < k)
        head = jnp.where(c < k, c // hd, 0)
        shape = (rows, width)
        bb = jnp.broadcast_to(jnp.where(r < m, r // t, 0), shape)
        kvh = jnp.broadcast_to(head // g, shape)
        row = jnp.broadcast_to(jnp.where(r < m, r % t, 0) * g + head % g, shape)
        lane = jnp.broadcast_to(c % hd, shape)

        def split(i, carry):  # one split folded into the running (peak, numerator, denominator)
            peak, num, den = carry
            sp = jnp.full(shape, i, jnp.int32)
            ms = plgpu.load(m_ref.at[bb, kvh, sp, row], mask=ok, other=-1e30)
            ls = plgpu.load(ssum_ref.at[bb, kvh, sp, row], mask=ok, other=0.0)
            a = plgpu.load(acc_ref.at[bb, kvh, sp, row, lane], mask=ok, other=0.0)
            new = jnp.maximum(peak, ms)
            old, w = jnp.exp(peak - new), jnp.exp(ms - new)
            return new, num * old + a * w, den * old + ls * w

        zero = jnp.zeros(shape, jnp.float32)
        carry = (zero - 1e30, zero, zero)
        for i in range(n_splits):  # unrolled: the splits' loads do not wait on the running fold
            carry = split(i, carry)
        _, num, den = carry
        out = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
        return _round(out, dt)

    def prologue(*cols):
        return [merged(cs) for cs in cols]

    _project(prologue, weights, widths, o_ref, k0=k0, kdim=k, m=m, bn=bn, bk=bk, rows=rows, dt=dt)


def _grid(widths, k: int, bn: int, bk: int, specs=()):
    check_tiles(bn, bk, specs)
    return (sum(-(-n // bn) for n in widths), n_splits(k, bk))


def _call(kernel, grid, out_shape, args, interpret, name, num_warps):
    return pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or NUM_WARPS, num_stages=1),
        interpret=interpret,
        name=name,
    )(*args)


def _partials(m, widths, k, bk):
    return jax.ShapeDtypeStruct((n_splits(k, bk), m, sum(widths)), jnp.float32)


def _weights(ws) -> tuple[tuple, tuple, tuple]:
    """(the weights' arrays side by side, their static specs, their widths)."""
    arrays, specs = [], []
    for w in ws:
        a, spec = operands(w)
        arrays += a
        specs.append(spec)
    return tuple(arrays), tuple(specs), tuple(w.shape[1] for w in ws)


Weights = tuple[Float[Array, "k _"] | QuantizedWeight, ...]


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "bn", "bk", "num_warps"))
def norm_project(
    x: Float[Array, "m k"],
    pending: Float[Array, "p m k"] | None,
    g: Float[Array, " k"],
    ws: Weights,
    *,
    eps: float,
    interpret: bool = False,
    bn: int | None = None,
    bk: int | None = None,
    num_warps: int | None = None,
) -> tuple[Float[Array, "m k"], Float[Array, "s m n"]]:
    """The kernel version of :func:`norm_project_reference`: ``(x', partials)``. A weight may
    be a ``QuantizedWeight`` (dequantized in the kernel)."""
    (m, k), bn, bk = x.shape, bn or BN, bk or BK
    arrays, specs, widths = _weights(ws)
    parts = 0 if pending is None else pending.shape[0]
    kern = functools.partial(
        _norm_kernel, specs=specs, parts=parts, widths=widths, m=m, k=k, eps=eps, bn=bn, bk=bk,
        rows=rows_of(m), dt=x.dtype,
    )  # fmt: skip
    args = (x, *(() if pending is None else (pending,)), g, *arrays)
    shapes = (_partials(m, widths, k, bk), jax.ShapeDtypeStruct(x.shape, x.dtype))
    grid = _grid(widths, k, bn, bk, specs)
    part, settled = _call(kern, grid, shapes, args, interpret, "norm_project", num_warps)
    return settled, part


@functools.partial(jax.jit, static_argnames=("interpret", "bn", "bk", "num_warps"))
def project(
    a: Float[Array, "m k"],
    ws: Weights,
    *,
    interpret: bool = False,
    bn: int | None = None,
    bk: int | None = None,
    num_warps: int | None = None,
) -> Float[Array, "s m n"]:
    """``[a @ w for w in ws]`` as float32 partials ``[S, M, sum N]``."""
    (m, k), bn, bk = a.shape, bn or BN, bk or BK
    arrays, specs, widths = _weights(ws)
    kern = functools.partial(
        _plain_kernel, specs=specs, widths=widths, m=m, k=k, bn=bn, bk=bk, rows=rows_of(m),
        dt=a.dtype,
    )  # fmt: skip
    shape = _partials(m, widths, k, bk)
    grid = _grid(widths, k, bn, bk, specs)
    return _call(kern, grid, shape, (a, *arrays), interpret, "project", num_warps)


@functools.partial(jax.jit, static_argnames=("interpret", "bn", "bk", "num_warps"))
def silu_project(
    gate_up: Float[Array, "p m f2"],
    w: Float[Array, "f n"] | QuantizedWeight,
    *,
    interpret: bool = False,
    bn: int | None = None,
    bk: int | None = None,
    num_warps: int | None = None,
) -> Float[Array, "s m n"]:
    """The kernel version of :func:`silu_project_reference`, as partials; ``gate_up`` holds the
    partials of ``norm_project(..., (w_gate, w_up))``."""
    parts, m, f2 = gate_up.shape
    k, bn, bk = f2 // 2, bn or BN, bk or BK
    arrays, specs, widths = _weights((w,))
    kern = functools.partial(
        _silu_kernel, specs=specs, parts=parts, widths=widths, m=m, k=k, bn=bn, bk=bk,
        rows=rows_of(m), dt=compute_dtype(w),
    )  # fmt: skip
    shape = _partials(m, widths, k, bk)
    grid = _grid(widths, k, bn, bk, specs)
    return _call(kern, grid, shape, (gate_up, *arrays), interpret, "silu_project", num_warps)


# The attention splits a combine_project merges, where the attention tile leaves the split length
# open (rope_attention_splits' min_split and max_splits): at least 128 slots, at most 33 splits,
# folded with their loads unrolled. On one H100 (results/attention_split.json, SmolLM2, batch 1)
# splits of 128 made the step 0.632 ms at 1K (9 splits; 5 of 256: 0.653) and 0.687 at 4K (33; 9
# of 512: 0.720). The fold it replaced ran the splits in turn (296 us a step at 33 on the H200,
# so the bound was 9). The bound keeps the unrolled fold small at 16K; batch 128 (2 splits):
# no change.
COMBINE_MIN_SPLIT = 128
COMBINE_SPLITS = 33
COMBINE_BOUNDS = {"min_split": COMBINE_MIN_SPLIT, "max_splits": COMBINE_SPLITS}


@functools.partial(jax.jit, static_argnames=("t", "interpret", "bn", "bk", "num_warps"))
def combine_project(
    acc: Float[Array, "b kh splits mp hd"],
    m: Float[Array, "b kh splits mp"],
    ssum: Float[Array, "b kh splits mp"],
    w: Float[Array, "k n"] | QuantizedWeight,
    *,
    t: int,
    interpret: bool = False,
    bn: int | None = None,
    bk: int | None = None,
    num_warps: int | None = None,
) -> Float[Array, "s rows n"]:
    """The kernel version of :func:`combine_project_reference`, as partials: o_proj that merges
    the attention kernel's splits (``rope_attention.Splits``) as it loads its input, so the
    combine needs no kernel of its own. ``t`` is the block's token count."""
    b, kh, n_split, _, hd = acc.shape
    k, bn, bk = w.shape[0], bn or BN, bk or BK
    g = k // hd // kh
    rows_m = b * t
    arrays, specs, widths = _weights((w,))
    kern = functools.partial(
        _combine_kernel, specs=specs, n_splits=n_split, t=t, g=g, hd=hd, widths=widths,
        m=rows_m, k=k, bn=bn, bk=bk, rows=rows_of(rows_m), dt=compute_dtype(w),
    )  # fmt: skip
    shape = _partials(rows_m, widths, k, bk)
    grid = _grid(widths, k, bn, bk, specs)
    args = (acc, m, ssum, *arrays)
    return _call(kern, grid, shape, args, interpret, "combine_project", num_warps)
