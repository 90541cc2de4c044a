"""The pure-jnp references every attention kernel is checked against: rotary embedding, the
visibility of cache slots implied by (prefix length, block mask), the cache scatter and
grouped-query attention over a cache block. jaxspec's plain path runs these same functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def scatter_rows(
    cache_k: Float[Array, "b s kh hd"], new: Float[Array, "b t kh hd"], slots: Int[Array, "b t"]
) -> Float[Array, "b s kh hd"]:
    """Scatter this block's K or V into its slots; slots past the capacity are dropped."""
    rows = jnp.arange(cache_k.shape[0])[:, None]
    return cache_k.at[rows, slots].set(new.astype(cache_k.dtype), mode="drop")


def visible(
    length: Int[Array, " b"], block_mask: Bool[Array, "b t n"], s: int
) -> Bool[Array, "b t s"]:
    """The full ``[B, T, S]`` visibility of cache slots implied by (length, block_mask)."""
    n = block_mask.shape[-1]
    slot = jnp.arange(s, dtype=jnp.int32)[None, None, :]
    rel = slot - length[:, None, None]
    in_block = (rel >= 0) & (rel < n)
    from_block = jnp.take_along_axis(
        block_mask, jnp.broadcast_to(jnp.clip(rel, 0, n - 1), block_mask.shape[:2] + (s,)), axis=2
    )
    return (rel < 0) | (in_block & from_block)


def apply_rope(x: Float[Array, "b t h hd"], cos, sin) -> Float[Array, "b t h hd"]:
    """Rotate-half RoPE (HF layout: the two halves of each head are the pair), in float32."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def attend(
    q: Float[Array, "b t h hd"],
    k: Float[Array, "b s kh hd"],
    v: Float[Array, "b s kh hd"],
    length: Int[Array, " b"],
    block_mask: Bool[Array, "b t n"],
) -> Float[Array, "b t h hd"]:
    """Grouped-query attention of T queries over the cache: prefix slots plus allowed block slots.

    Scores and softmax run in float32; a query that sees nothing (padding) returns zeros.
    """
    b, t, h, hd = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, h // kh, hd).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) / jnp.sqrt(jnp.float32(hd))
    mask = visible(length, block_mask, k.shape[1])[:, None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    w = jnp.exp(scores - peak)
    denom = jnp.sum(w, axis=-1, keepdims=True)
    w = w / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgts,bskd->btkgd", w, v.astype(jnp.float32))
    return out.reshape(b, t, h, hd).astype(q.dtype)


attend_jit = jax.jit(attend)
