"""Attention over a KVCache block spec: the pure-jnp reference every kernel is checked against,
and the rotary embedding the model and the fused kernel's reference apply."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxspec.kv_cache import visible


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
