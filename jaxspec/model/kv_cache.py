"""Functional KV caches and the attention-mask spec every forward takes.

Layout (the same for the target's dense cache, a draft's tree cache and a sparse-budget cache):
slots ``[0, length[b])`` hold the committed prefix of row b; slots ``[length[b], length[b] + N)``
are the *block*: the tokens being decoded, verified or speculated this step (a chain, a tree, or
a prefill chunk). A query sees every prefix slot and the block slots its ``block_mask`` row allows.

A forward writes the new tokens' K/V at ``slots`` (one scatter per layer, out-of-range slots are
dropped) and never copies the cache; committing a verified path (``commit``) moves at most the
path's K/V and advances ``length``.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxspec.config import ModelConfig
from jaxspec.kernels import resolve
from jaxspec.pytree import pytree_dataclass
from pallas_kernels import kv_commit

# The commit's K/V moves in one Pallas kernel for every cache (pallas_kernels/kv_commit.py)
# instead of a gather and a scatter per cache: 'off' (the default: not measured on a GPU yet),
# 'auto' (on GPU, unless the caches are sharded), 'pallas', 'interpret' (CPU tests).
FUSED_COMMIT = os.environ.get("JAXSPEC_FUSED_COMMIT", "off")


@pytree_dataclass
class KVCache:
    """Per-layer keys and values ``[B, S, KH, hd]`` (keys stored after RoPE) and lengths ``[B]``."""

    k: list[Float[Array, "b s kh hd"]]
    v: list[Float[Array, "b s kh hd"]]
    length: Int[Array, " b"]

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]


@pytree_dataclass
class Block:
    """What one forward computes: T query tokens per row and where their K/V go.

    positions:  RoPE position of each token.
    slots:      cache slot that receives each token's K/V (>= capacity: not written).
    block_mask: ``block_mask[b, t, j]``: query t may see slot ``length[b] + j``.
    appended:   (static) token i goes to slot ``length[b] + i`` or nowhere, and block column j is
                token j: a decode step, a chain verify, a tree verify. The fused RoPE + cache
                write + attention kernel takes only these (``pallas_kernels/rope_attention.py``).
    """

    positions: Int[Array, "b t"]
    slots: Int[Array, "b t"]
    block_mask: Bool[Array, "b t n"]
    appended: bool = dataclasses.field(default=False, metadata={"static": True})


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        k=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
        v=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
        length=jnp.zeros((batch,), jnp.int32),
    )


def causal_block(
    length: Int[Array, " b"], start: Int[Array, " b"], valid: Int[Array, " b"], t: int
) -> Block:
    """A block of ``t`` consecutive tokens per row appended after the prefix (prefill chunk,
    decode step, chain verify). Token i of row b sits at slot ``length[b] + i`` with position
    ``start[b] + i``; tokens ``i >= valid[b]`` are padding: they see nothing and are not written."""
    i = jnp.arange(t, dtype=jnp.int32)
    real = i[None, :] < valid[:, None]
    causal = i[None, :, None] >= i[None, None, :]
    mask = causal & real[:, None, :] & real[:, :, None]
    slots = jnp.where(real, length[:, None] + i[None, :], jnp.iinfo(jnp.int32).max)
    return Block(positions=start[:, None] + i[None, :], slots=slots, block_mask=mask, appended=True)


def commit(cache: KVCache, src: Int[Array, "b k"], count: Int[Array, " b"]) -> KVCache:
    """Append ``count[b]`` block tokens to the prefix of row b.

    ``src[b, i]`` is the slot (inside the block) holding the i-th token to commit; it moves to
    slot ``length[b] + i``. For a chain ``src`` is already ``length + i`` and the move is a no-op
    in effect; for a tree it gathers the accepted path. Only ``k = src.shape[1]`` slots per row
    and layer are read and written: no cache copy, no recompute.
    """
    k = src.shape[1]
    i = jnp.arange(k, dtype=jnp.int32)
    keep = i[None, :] < count[:, None]
    dst = jnp.where(keep, cache.length[:, None] + i[None, :], jnp.iinfo(jnp.int32).max)
    layers = len(cache.k)
    mode = resolve(FUSED_COMMIT, "JAXSPEC_FUSED_COMMIT")
    if mode is None:
        moved = kv_commit.reference(cache.k + cache.v, src, dst)
    else:
        moved = kv_commit.move_rows(cache.k + cache.v, src, dst, interpret=mode == "interpret")
    return KVCache(
        k=moved[:layers], v=moved[layers:], length=cache.length + count.astype(jnp.int32)
    )
