"""Numerics in which a row's result never depends on what else its step computes
(``KernelConfig(invariant=True)``): speculative output equal to autoregressive output bit for bit.

A float sum's rounding depends on the order and grouping of its terms, and every kernel picks
both by shape: a GEMM's K tiling by its row count, a split-K attention's splits by how many
queries share the step, a reduction's tree by the array's length. So a token's logits differ,
by an ulp here and there, between a one-token decode step, a chain verify of gamma + 1 tokens, a
tree verify whose accepted path sits at scattered cache slots, and a prefill chunk, and greedy
decoding parts at near-ties (6 of 16 rows for chain + prompt lookup on SmolLM2 in bf16, H200).

Here every reduction of the forward (projections and LM head over K, RMSNorm's mean square, the
attention scores over head_dim, the softmax normaliser and the weighted sum over keys) is an
``exact_sum``: each float32 term is rounded once, on its own, to a multiple of 2^-32, and the
terms are added as int64, which is associative. The sum is then the same for any order, grouping,
padding, row count or key layout, on any backend: a row's result depends on its own inputs only.
Elementwise work is the same instruction per element in every program, with one exception that
this module closes: a compiler may fuse a product into a following add (an FMA, one rounding
instead of two), and whether it does depends on how the program around it was fused (XLA's CPU
backend does it in jitted fusions, not op by op). So where a product meets an add (RoPE's
rotation, the norm's mean plus epsilon, the scaled scores minus their peak) the product goes
through ``rounded``: an optimisation barrier, after which it is always its own rounded float.
Attention is over the set of visible keys, wherever the cache holds them.

The price is arithmetic without tensor cores and, for a bf16 model, products formed in float32:
the invariant path is several times slower (measured in benchmarks/results/bit_exact.json), so it
is a setting (CLI ``--exact``), not the default. The terms' grid (2^-32) keeps sums up to 2^31 in
magnitude; the float32 terms themselves round relative to ~6e-8, so the result is at least as
precise as a float32 accumulator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.reference import visible

SCALE = 2.0**32


def exact_sum(terms: Float[Array, "..."], axis: int) -> Float[Array, "..."]:
    """``sum(terms, axis)`` in float32, the same bits for any order of the terms."""
    with jax.enable_x64(True):
        q = jnp.round(terms.astype(jnp.float64) * SCALE).astype(jnp.int64)
        return (jnp.sum(q, axis=axis).astype(jnp.float64) / SCALE).astype(jnp.float32)


def rounded(x):
    """``x`` materialised as its own rounded value: no FMA can fuse it into a following add."""
    return jax.lax.optimization_barrier(x)


def exact_dot(x: Float[Array, "... k"], w: Float[Array, "k n"]) -> Float[Array, "... n"]:
    """``x @ w`` in float32 by ``exact_sum`` over K (products in float32)."""
    terms = x.astype(jnp.float32)[..., :, None] * w.astype(jnp.float32)
    return exact_sum(terms, axis=-2)


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


def attend(
    q: Float[Array, "b t h hd"],
    k: Float[Array, "b s kh hd"],
    v: Float[Array, "b s kh hd"],
    length: Int[Array, " b"],
    block_mask: Bool[Array, "b t n"],
) -> Float[Array, "b t h hd"]:
    """Grouped-query attention as ``pallas_kernels.reference.attend`` (prefix plus the allowed
    block slots; a query that sees nothing gives zeros), every sum exact: the result depends on
    the set of visible keys only, not on their slots, the cache's size or the other queries."""
    b, t, h, hd = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, h // kh, hd).astype(jnp.float32)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    # [b, kh, g, t, s, hd] products, summed over hd
    prods = (
        qg.transpose(0, 2, 3, 1, 4)[:, :, :, :, None, :]
        * kf.transpose(0, 2, 1, 3)[:, :, None, None]
    )
    scores = rounded(exact_sum(prods, axis=-1) / jnp.sqrt(jnp.float32(hd)))
    mask = visible(length, block_mask, k.shape[1])[:, None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    w = jnp.where(mask, jnp.exp(scores - peak), 0.0)
    denom = exact_sum(w, axis=-1)[..., None]
    # [b, kh, g, t, s, hd] weighted values, summed over the keys
    num = exact_sum(w[..., None] * vf.transpose(0, 2, 1, 3)[:, :, None, None], axis=-2)
    out = jnp.where(denom > 0, num / jnp.where(denom > 0, denom, 1.0), 0.0)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, hd).astype(q.dtype)
