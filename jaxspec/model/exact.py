"""Numerics in which a row's result never depends on what else its step computes
(``KernelConfig(invariant=True)``): speculative output equal to autoregressive output bit for bit.

A float sum's rounding depends on the order and grouping of its terms, and kernels pick both by
shape: a GEMM's tiling by its row count (XLA's CPU backend computes a one-row product by another
path than a 9-row one, to other bits), a split-K attention's splits by how many queries share the
step, a reduction's tree by the array's length. So a token's logits differ, by an ulp here and
there, between a one-token decode step, a chain verify of gamma + 1 tokens, a tree verify whose
accepted path sits at scattered cache slots, and a prefill chunk; and greedy decoding parts at
near-ties (6 of 16 rows for chain + prompt lookup on SmolLM2 in bf16, one H200).

Here:

- every projection and the LM head run as GEMMs of one shape: the rows padded to ``TILE`` and
  multiplied a tile at a time (``tiled_matmul``), each tile's product fenced off by optimisation
  barriers so no program fuses it differently. One kernel for one shape computes each row the
  same way whatever the other rows hold. (Rows past a tile's real ones cost a decode step
  nothing; large prefill chunks and batches pay one weight read per tile.)
- the short reductions (RMSNorm's mean square, the attention scores over head_dim, the softmax
  normaliser and the weighted sum over keys) are ``exact_sum``: each float32 term is rounded on
  its own to a multiple of 2^-32 and the terms are added as int64, which is associative, so the
  sum is the same for any order, grouping or padding. Attention is thus a function of the set of
  visible keys only, wherever the cache holds them (a tree's path, a chain's block, a prefix).
- a product that meets an add goes through ``rounded`` (an optimisation barrier): a compiler may
  fuse ``a * b + c`` into one FMA in one program and not in another (XLA's CPU backend does it in
  jitted fusions), which rounds differently.
- programs compile without excess precision and, on a GPU, without autotuning
  (``KernelConfig.compiler_options``): otherwise XLA may skip a bf16 rounding inside a fusion,
  or pick another GEMM kernel for the same shape in another process.

The price is a slower target (measured in benchmarks/results/bit_exact.json): a setting (CLI
``--exact``), not the default. Drafts keep their fast numerics: they change how many tokens are
accepted, never which.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.reference import visible

SCALE = 2.0**32  # exact_sum's grid: sums up to 2^31 in magnitude fit an int64
TILE = 16  # rows of every invariant GEMM; also queries per exact-attention tile


def exact_sum(terms: Float[Array, "..."], axis: int) -> Float[Array, "..."]:
    """``sum(terms, axis)`` in float32, the same bits for any order of the terms."""
    with jax.enable_x64(True):
        q = jnp.round(terms.astype(jnp.float64) * SCALE).astype(jnp.int64)
        return (jnp.sum(q, axis=axis).astype(jnp.float64) / SCALE).astype(jnp.float32)


def rounded(x):
    """``x`` materialised as its own rounded value: no FMA can fuse it into a following add."""
    return jax.lax.optimization_barrier(x)


def tiled_matmul(x: Float[Array, "... k"], w: Float[Array, "k n"], out_dtype=None):
    """``x @ w`` as GEMMs of ``TILE`` rows, one at a time: every row is computed by the same
    kernel for the same shape, in any program. ``out_dtype``: the result type (accumulation at
    least as precise).

    The tiles go through a ``while`` loop whose trip count XLA cannot see (the count passes an
    optimisation barrier), so the GEMM sits in the same loop body whether the step has one tile
    or many. With a visible count, a one-tile loop (a decode step of up to 16 rows) is inlined
    into the program while a verify block's loop stays a loop, and XLA may then compile the two
    GEMMs differently (merge the inlined one with its sibling projections, pick another kernel):
    on an H200 that parted 15 of 16 rows of a batch-16 run from autoregressive decoding, while
    batch 1, whose verify blocks fit one tile too, parted none (benchmarks/notes/bit_exact.md)."""
    k, n = w.shape
    rows = x.size // k
    tiles = -(-rows // TILE)
    flat = jnp.pad(x.reshape(rows, k), ((0, tiles * TILE - rows), (0, 0)))
    dtype = jnp.result_type(x.dtype, w.dtype) if out_dtype is None else out_dtype
    count = rounded(jnp.int32(tiles))

    def body(carry):
        i, out = carry
        tile = rounded(jax.lax.dynamic_slice_in_dim(flat, i * TILE, TILE))
        y = rounded(jnp.matmul(tile, w, preferred_element_type=out_dtype).astype(dtype))
        return i + 1, jax.lax.dynamic_update_slice_in_dim(out, y, i * TILE, 0)

    start = (jnp.int32(0), jnp.zeros((tiles * TILE, n), dtype))
    _, y = jax.lax.while_loop(lambda c: c[0] < count, body, start)
    return y[:rows].reshape(*x.shape[:-1], n)


def exact_rms(x: Float[Array, "... d"], eps: float) -> Float[Array, "... d"]:
    """``x / sqrt(mean(x^2) + eps)`` in float32 (HF's RMSNorm before the weight)."""
    xf = x.astype(jnp.float32)
    mean = rounded(exact_sum(xf * xf, axis=-1)[..., None] / jnp.float32(x.shape[-1]))
    return xf * jax.lax.rsqrt(mean + eps)


def rope(x: Float[Array, "b t h hd"], cos, sin) -> Float[Array, "b t h hd"]:
    """``pallas_kernels.reference.apply_rope`` with each product rounded on its own."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    a, b, cc, d = rounded((x1 * c, x2 * s, x2 * c, x1 * s))
    return jnp.concatenate([a - b, cc + d], axis=-1).astype(x.dtype)


def _attend_tile(q, kf, vf, mask):
    """Exact attention of a tile of queries ``q [b, kh, g, tq, hd]`` over the keys ``[b, kh, s,
    hd]`` they may see (``mask [b, 1, 1, tq, s]``): ``[b, kh, g, tq, hd]`` float32."""
    hd = q.shape[-1]
    scores = exact_sum(q[:, :, :, :, None, :] * kf[:, :, None, None], axis=-1)
    scores = rounded(scores / jnp.sqrt(jnp.float32(hd)))
    scores = jnp.where(mask, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    w = jnp.where(mask, jnp.exp(scores - peak), 0.0)
    denom = exact_sum(w, axis=-1)[..., None]
    num = exact_sum(w[..., None] * vf[:, :, None, None], axis=-2)
    return jnp.where(denom > 0, num / jnp.where(denom > 0, denom, 1.0), 0.0)


def attend(
    q: Float[Array, "b t h hd"],
    k: Float[Array, "b s kh hd"],
    v: Float[Array, "b s kh hd"],
    length: Int[Array, " b"],
    block_mask: Bool[Array, "b t n"],
) -> Float[Array, "b t h hd"]:
    """Grouped-query attention as ``pallas_kernels.reference.attend`` (prefix plus the allowed
    block slots; a query that sees nothing gives zeros), every sum exact: the result depends on
    the set of visible keys only, not on their slots, the cache's size or the other queries.
    Queries go at most ``TILE`` at a time (the products of a tile over the whole cache fit in
    memory); a step of fewer is one tile of its own size, not padded (a query's sums are exact
    for any tile, and a decode step's one query would otherwise cost sixteen)."""
    b, t, h, hd = q.shape
    kh = k.shape[2]
    size = min(t, TILE)
    tiles = -(-t // size)
    pad = tiles * size - t
    qg = q.reshape(b, t, kh, h // kh, hd).astype(jnp.float32).transpose(0, 2, 3, 1, 4)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))
    mask = visible(length, jnp.pad(block_mask, ((0, 0), (0, pad), (0, 0))), k.shape[1])
    kf = k.astype(jnp.float32).transpose(0, 2, 1, 3)
    vf = v.astype(jnp.float32).transpose(0, 2, 1, 3)
    qt = qg.reshape(b, kh, h // kh, tiles, size, hd).transpose(3, 0, 1, 2, 4, 5)
    mt = mask.reshape(b, tiles, size, -1).transpose(1, 0, 2, 3)[:, :, None, None]
    out = jax.lax.map(lambda a: _attend_tile(a[0], kf, vf, a[1]), (qt, mt))
    out = out.transpose(1, 2, 3, 0, 4, 5).reshape(b, kh, h // kh, tiles * size, hd)[..., :t, :]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, hd).astype(q.dtype)
