"""Quantized projections for decode and verify steps: ``x @ w`` for a ``QuantizedWeight`` ``w``,
its codes dequantized inside the kernel (HBM -> registers; no float copy of the weight is ever
written), for steps of at most ``MAX_ROWS`` rows. Prefill and large batches take the XLA path
(``pallas_kernels.quant.dequantize`` then a GEMM, which XLA fuses as it can).

``qmatmul(x, w)``: program ``(j, s)`` of the grid ``(column tiles, K splits)`` walks its split's
K rows in tiles of ``bk`` (a loop Triton pipelines over ``num_stages``): it loads the tile's
codes ``[bk, bn]`` (4 bits: ``[bk/2, bn]`` bytes) and their scales, dequantizes them in float32,
rounds to ``x``'s dtype, and multiplies them with the rows' activations in float32. It stores
partial sum ``s``: ``[S, M, N]`` float32, which the caller sums (``S = 1``: nothing to sum).

Scales are loaded once per distinct row a tile needs, never per weight element: a tile inside
one group (per-channel int8: one group of all K; groups of a whole number of tiles) loads one
``[1, bn]`` row that broadcasts over the tile; a tile cut by smaller groups loads one row per
run of ``scale_run`` rows and repeats it over the run in registers. The first version gathered
a scale for every element of every tile: ``[bk, bn]`` loads, pipelined through shared memory
like the codes (a 64 x 512 int8 tile in 4 stages asked for 344,064 bytes: 3 x (32 KiB of codes,
64 KiB of float16 scales, 16 KiB of activations)), and it read its codes at 0.41-0.67 TB/s on
an H200 (benchmarks/notes/quantized.md).

A 4-bit tile gives two float tiles, the low and the high nibbles, each of which multiplies the
activations of its own rows of K (``quant.low_row``): two dots of ``bk/2``, no shuffle of the
codes in registers. In a tile inside one group those rows are two runs of ``bk/2`` columns
(contiguous loads); otherwise they are gathered.

``weight_tiles``, ``load_cols`` and ``tile_dot`` are shared with ``fused_linear``: its split-K
projection kernels take quantized weights the same way, so a small model's layer stays four
projection kernels.

Numerics: the dequantized tile is ``quant.dequantize``'s to the bit (the same float32
operations), so only the order of the sums differs from dequantize-then-matmul.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from pallas_kernels import quant
from pallas_kernels.quant import QuantizedWeight

MAX_ROWS = 16  # more rows: a GEMM is compute bound, the XLA path wins
DOT_ROWS = 16  # tensor-core rows: qmatmul pads every step to them; fused kernels sum one row
# Wide tiles (256-byte rows of int8 codes or packed int4 bytes) inside a group of 128. Two H200
# sweeps of bench_quantized.py (2026-12-03, benchmarks/notes/quantized.md) put every 256-wide
# tile within ~10% of another and of a bf16 GEMM timed the same way (about 50 us a call there),
# ranking them differently run to run; in the decode steps this tile took Llama-3-8B's int8
# step to 5.3-5.7 ms (29.6 with the per-element scale gathers) and int4 to 4.9-5.1 (13.1)
BN, BK, NUM_WARPS, NUM_STAGES = 256, 128, 4, 3
TARGET_PROGRAMS = 264  # two programs per SM of an H200 (132 SMs): K splits are added up to this
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class Weight:
    """A weight as a kernel sees it: its refs and its static format (``bits`` None: dense)."""

    refs: tuple
    bits: int | None = None
    group: int = 0


def operands(w) -> tuple[tuple, tuple]:
    """A weight (dense array or ``QuantizedWeight``) as the kernel's arrays and its static spec
    ``(bits, group, has_mins)``; ``regroup`` rebuilds the ``Weight`` inside the kernel."""
    if not quant.is_quantized(w):
        return (w,), (None, 0, False)
    arrays = (w.values, w.scales) + (() if w.mins is None else (w.mins,))
    return arrays, (w.bits, w.group, w.mins is not None)


def regroup(refs, specs) -> list[Weight]:
    """The kernel's weight refs (flat, in ``operands`` order) as ``Weight``s."""
    out, i = [], 0
    for bits, group, has_mins in specs:
        n = 1 if bits is None else 2 + has_mins
        out.append(Weight(tuple(refs[i : i + n]), bits, group))
        i += n
    return out


def compute_dtype(w):
    return jnp.dtype(w.dtype)


def load_cols(ref, rows: int, m: int, cols, limit: int, *lead):
    """``ref[*lead, :rows, cols]`` in float32; rows past ``m`` and columns past ``limit`` read as
    zero. ``cols``: ``(start, width)`` (contiguous) or a vector of column indices (a gather)."""
    r = jnp.arange(rows)
    if isinstance(cols, tuple):
        c0, width = cols
        ok = (r < m)[:, None] & ((c0 + jnp.arange(width)) < limit)[None, :]
        idx = (*(jnp.int32(i) for i in lead), pl.ds(0, rows), pl.ds(c0, width))
        return plgpu.load(ref.at[idx], mask=ok, other=0.0).astype(jnp.float32)
    shape = (rows, cols.shape[0])
    ok = (r < m)[:, None] & (cols < limit)[None, :]
    rr = jnp.broadcast_to(r[:, None], shape)
    cc = jnp.broadcast_to(jnp.where(cols < limit, cols, 0)[None, :], shape)
    idx = (*(jnp.full(shape, i, jnp.int32) for i in lead), rr, cc)
    return plgpu.load(ref.at[idx], mask=ok, other=0.0).astype(jnp.float32)


def _finish(q, s, m, bits: int, dt):
    """Codes ``q`` and their scales (float32 tiles) as the weight's values in ``dt``."""
    if m is not None:
        f = q * s + m
    else:
        f = (q - quant.OFFSET4) * s if bits == 4 else q * s
    return f.astype(dt)


def scale_run(group: int, bk: int, kdim: int) -> int:
    """Rows of K in a ``bk``-row tile that share one scale row: the whole tile when it lies in
    one group (one group in all, or groups of a whole number of tiles), else the largest power
    of two dividing ``group`` (runs of it never cross a group's edge)."""
    return bk if group == kdim else min(bk, group & -group)


def _scales(w: Weight, k0, bk: int, c, bn: int, kdim: int, col_ok):
    """Scales (and mins) in float32 for the tile of rows ``[k0, k0 + bk)`` of K, columns
    ``[c, c + bn)``: ``[1, bn]`` when the tile lies in one group (it broadcasts over the tile's
    rows), else one row per run of ``scale_run`` rows, repeated over the run's rows of the
    codes (``run`` rows of 8-bit codes, ``run / 2`` packed rows of 4-bit ones). Only the tile's
    distinct scale rows are loaded."""
    run = scale_run(w.group, bk, kdim)
    runs, per = bk // run, run * w.bits // 8
    starts = k0 + jnp.arange(runs) * run
    live = starts < kdim
    shape = (runs, bn)
    gg = jnp.broadcast_to(jnp.where(live, starts // w.group, 0)[:, None], shape)
    cc = jnp.broadcast_to(c + jnp.arange(bn)[None, :], shape)

    def load(ref):
        v = plgpu.load(ref.at[gg, cc], mask=live[:, None] & col_ok, other=0.0)
        v = v.astype(jnp.float32)
        if runs == 1:
            return v
        return jnp.broadcast_to(v[:, None, :], (runs, per, bn)).reshape(runs * per, bn)

    return load(w.refs[1]), load(w.refs[2]) if len(w.refs) > 2 else None


def weight_tiles(w: Weight, k0, bk: int, c, bn: int, kdim: int, n: int, dt):
    """The weight's rows ``[k0, k0 + bk)`` and columns ``[c, c + bn)`` as float tiles in ``dt``,
    each with the rows of K it holds (``load_cols``' ``cols``): one tile for a dense or 8-bit
    weight, two (low and high nibbles) for a 4-bit one. Past the weight's ends: zeros, or
    finite values whose rows of K are past K (``load_cols`` reads those activations as zero)."""
    col_ok = ((c + jnp.arange(bn)) < n)[None, :]
    if w.bits is None or w.bits == 8:
        ok = ((k0 + jnp.arange(bk)) < kdim)[:, None] & col_ok
        tile = plgpu.load(w.refs[0].at[pl.ds(k0, bk), pl.ds(c, bn)], mask=ok, other=0)
        if w.bits is None:
            return [((k0, bk), tile)]
        s, m = _scales(w, k0, bk, c, bn, kdim, col_ok)
        return [((k0, bk), _finish(tile.astype(jnp.float32), s, m, 8, dt))]
    half, ghalf = bk // 2, w.group // 2
    prow = k0 // 2 + jnp.arange(half)
    ok = (prow < kdim // 2)[:, None] & col_ok
    packed = plgpu.load(w.refs[0].at[pl.ds(k0 // 2, half), pl.ds(c, bn)], mask=ok, other=0)
    s, m = _scales(w, k0, bk, c, bn, kdim, col_ok)
    lo = _finish((packed & 15).astype(jnp.float32), s, m, 4, dt)
    hi = _finish((packed >> 4).astype(jnp.float32), s, m, 4, dt)
    if w.group % bk == 0:
        # the packed rows lie in group k0 // group, so their low rows are one run (a tile past
        # K's end starts past K, where the activations read as zero); else they are gathered
        # (groups smaller than bk; one group of all K whose last tile hangs past K's end)
        start = pl.multiple_of(k0 // 2 + (k0 // w.group) * ghalf, half)
        return [((start, half), lo), ((start + ghalf, half), hi)]
    low = quant.low_row(prow, w.group)
    return [(low, lo), (low + ghalf, hi)]


def tile_dot(a, w, rows: int):
    """``a [rows, L]`` (float32 holding values of ``w``'s dtype) times ``w [L, bn]`` in float32."""
    if rows == 1:  # one row: products on the CUDA cores, summed over the tile
        return jnp.sum(a[:, :, None] * w.astype(jnp.float32)[None, :, :], axis=1)
    return jax.lax.dot_general(  # tensor cores; a holds values of w's dtype, so the cast is exact
        a.astype(w.dtype),
        w,
        (((1,), (0,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def rows_of(m: int) -> int:
    """The rows a fused projection kernel computes for ``m`` (``qmatmul`` always computes
    ``DOT_ROWS``: on an H200 the Llama-3-8B LM head's one-row sum took 481 us int8 and 536 us
    int4 a step, padded to the tensor cores' tile 237 and 180 us; its per-layer projections
    already get 8 rows (``KernelConfig.gemm_rows``), benchmarks/notes/quantized.md)."""
    return 1 if m == 1 else DOT_ROWS


# ---- the pure-jnp reference ---------------------------------------------------------------


def qmatmul_reference(x: Float[Array, "m k"], w: QuantizedWeight) -> Float[Array, "m n"]:
    """Dequantize-then-matmul: ``x @ dequantize(w)`` in float32."""
    wf = quant.dequantize(w, x.dtype)
    return jnp.matmul(
        x, wf, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


# ---- the kernel ---------------------------------------------------------------------------------


def unsupported_reason(x, w) -> str | None:
    """Why ``qmatmul`` cannot take these arrays (None when it can)."""
    if not quant.is_quantized(w):
        return "the weight is not quantized"
    if x.ndim != 2 or x.shape[1] != w.shape[0]:
        return f"rows {x.shape} do not take a weight of shape {w.shape}"
    if not 1 <= x.shape[0] <= MAX_ROWS:
        return f"{x.shape[0]} rows not in [1, {MAX_ROWS}]"
    if jnp.dtype(x.dtype) != compute_dtype(w) or compute_dtype(w) not in SUPPORTED_DTYPES:
        return f"rows of {x.dtype} with a weight computing in {w.dtype} (need one of bf16/f16/f32)"
    return None


def check_tiles(bn: int, bk: int, specs=()) -> None:
    """Raise ValueError for tiles the kernels cannot use: powers of two >= 16, and ``bk >= 32``
    with a 4-bit weight among ``specs`` (each nibble's half tile is a dot of ``bk / 2``)."""
    for name, v in (("bn", bn), ("bk", bk)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v}: the kernels' tiles must be powers of two >= 16")
    if bk < 32 and any(spec[0] == 4 for spec in specs):
        raise ValueError(f"bk={bk}: a 4-bit weight needs bk >= 32 (two dots of bk / 2 rows)")


def plan(k: int, n: int, bn: int, bk: int, splits: int | None, spec=(None,)) -> tuple[int, int]:
    """``(K splits, tiles a split)`` for a ``[K, N]`` weight of format ``spec`` (``operands``):
    ``splits`` (None: enough to give ``TARGET_PROGRAMS`` programs), each a whole number of
    ``bk`` tiles."""
    check_tiles(bn, bk, (spec,))
    k_tiles = math.ceil(k / bk)
    if splits is None:
        splits = max(1, TARGET_PROGRAMS // math.ceil(n / bn))
    tiles = math.ceil(k_tiles / max(1, min(splits, k_tiles)))
    return math.ceil(k_tiles / tiles), tiles


def _kernel(x_ref, *refs, spec, m, k, n, bn, bk, tiles, rows, dt):
    (w,), o_ref = regroup(refs[:-1], (spec,)), refs[-1]
    j, s = pl.program_id(0), pl.program_id(1)
    c = pl.multiple_of(j * bn, bn)

    def body(i, acc):
        k0 = pl.multiple_of((s * tiles + i) * bk, bk)
        # the codes' loads are issued before the activations' (a warp stalls at a load's first
        # use, not at the load), so the two round trips overlap
        pairs = weight_tiles(w, k0, bk, c, bn, k, n, dt)
        for cols, tile in pairs:
            acc = acc + tile_dot(load_cols(x_ref, rows, m, cols, k), tile, rows)
        return acc

    acc = jnp.zeros((rows, bn), jnp.float32)
    acc = body(0, acc) if tiles == 1 else jax.lax.fori_loop(0, tiles, body, acc)
    live = (jnp.arange(rows) < m)[:, None] & ((c + jnp.arange(bn)) < n)[None, :]
    plgpu.store(o_ref.at[s, pl.ds(0, rows), pl.ds(c, bn)], acc, mask=live)


@functools.partial(
    jax.jit, static_argnames=("interpret", "bn", "bk", "splits", "num_warps", "num_stages")
)
def qmatmul(
    x: Float[Array, "m k"],
    w: QuantizedWeight,
    *,
    interpret: bool = False,
    bn: int | None = None,
    bk: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Float[Array, "s m n"]:
    """``x @ w`` as float32 partial sums ``[S, M, N]`` (their sum is the product; see the
    module docstring). ``bn`` columns and ``bk`` rows of K a tile, ``splits`` K splits (None:
    by ``plan``)."""
    why = unsupported_reason(x, w)
    if why is not None:
        raise ValueError(f"qmatmul: {why}")
    (m, k), n = x.shape, w.shape[1]
    bn, bk = bn or BN, bk or BK
    arrays, spec = operands(w)
    n_split, tiles = plan(k, n, bn, bk, splits, spec)
    kern = functools.partial(
        _kernel, spec=spec, m=m, k=k, n=n, bn=bn, bk=bk, tiles=tiles, rows=DOT_ROWS,
        dt=x.dtype,
    )  # fmt: skip
    return pl.pallas_call(
        kern,
        grid=(math.ceil(n / bn), n_split),
        out_shape=jax.ShapeDtypeStruct((n_split, m, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or NUM_WARPS, num_stages=num_stages or NUM_STAGES
        ),
        interpret=interpret,
        name=f"qmatmul_int{w.bits}",
    )(x, *arrays)
