"""Functional KV caches, the attention-mask spec every forward takes, and the one KV move.

Layout (the same for the target's dense cache, a draft's tree cache and a sparse-budget cache):
slots ``[0, length[b])`` hold the committed prefix of row b; slots ``[length[b], length[b] + N)``
are the *block*: the tokens being decoded, verified or speculated this step (a chain, a tree, or
a prefill chunk). A query sees every prefix slot and the block slots its ``block_mask`` row allows.

A forward writes the new tokens' K/V at ``slots`` (one scatter per layer, out-of-range slots are
dropped) and never copies the cache. Committing moves at most the committed tokens' K/V with
``move`` (one gather and scatter per cache, or one kernel for every cache): into the dense prefix
(``commit``: a chain's is already in place, a tree's accepted path is gathered) or into a
StreamingLLM ring (``commit_ring``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxspec.config import ModelConfig
from jaxspec.pytree import pytree_dataclass
from pallas_kernels import kv_commit

NO_SLOT = jnp.iinfo(jnp.int32).max  # a slot past any capacity: nothing is written there


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
    fresh:      (static) a prompt's first chunk into an empty cache (``prefill.chunked``): a
                causal block whose queries see nothing but the block, so a wide one may attend
                over its own K/V through cuDNN (``KernelConfig.prefill_attention``).
    """

    positions: Int[Array, "b t"]
    slots: Int[Array, "b t"]
    block_mask: Bool[Array, "b t n"]
    appended: bool = dataclasses.field(default=False, metadata={"static": True})
    fresh: bool = dataclasses.field(default=False, metadata={"static": True})


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        k=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
        v=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
        length=jnp.zeros((batch,), jnp.int32),
    )


def causal_block(
    length: Int[Array, " b"],
    start: Int[Array, " b"],
    valid: Int[Array, " b"],
    t: int,
    *,
    fresh: bool = False,
) -> Block:
    """A block of ``t`` consecutive tokens per row appended after the prefix (prefill chunk,
    decode step, chain verify). Token i of row b sits at slot ``length[b] + i`` with position
    ``start[b] + i``; tokens ``i >= valid[b]`` are padding: they see nothing and are not written.
    ``fresh``: the caller's word that ``length`` is all zeros (``Block.fresh``)."""
    i = jnp.arange(t, dtype=jnp.int32)
    real = i[None, :] < valid[:, None]
    causal = i[None, :, None] >= i[None, None, :]
    mask = causal & real[:, None, :] & real[:, :, None]
    slots = jnp.where(real, length[:, None] + i[None, :], NO_SLOT)
    return Block(
        positions=start[:, None] + i[None, :], slots=slots, block_mask=mask, appended=True,
        fresh=fresh,
    )  # fmt: skip


def move(
    cache: KVCache,
    src: Int[Array, "b k"],
    dst: Int[Array, "b k"],
    length: Int[Array, " b"],
    *,
    mode: str = "off",
) -> KVCache:
    """Every layer's K/V rows at slots ``src[b, i]`` copied to ``dst[b, i]`` (all read before any
    is written; destinations at or past the capacity are dropped), with ``length`` the new
    lengths. ``mode`` is ``KernelConfig.fused_commit``: "off" is a gather and a scatter per
    cache, "pallas" / "interpret" one kernel for all of them (``pallas_kernels/kv_commit.py``).
    Only ``k = src.shape[1]`` rows per row and cache are read and written."""
    layers = len(cache.k)
    if mode == "off":
        moved = kv_commit.reference(cache.k + cache.v, src, dst)
    else:
        moved = kv_commit.move_rows(cache.k + cache.v, src, dst, interpret=mode == "interpret")
    return KVCache(k=moved[:layers], v=moved[layers:], length=length.astype(jnp.int32))


def commit(
    cache: KVCache, src: Int[Array, "b k"], count: Int[Array, " b"], *, mode: str = "off"
) -> KVCache:
    """Append ``count[b]`` block tokens to the prefix of row b.

    ``src[b, i]`` is the slot (inside the block) holding the i-th token to commit; it moves to
    slot ``length[b] + i``: a tree's accepted path is gathered behind the prefix. (A chain's
    block is already in place: ``advance``.)
    """
    i = jnp.arange(src.shape[1], dtype=jnp.int32)
    dst = jnp.where(i[None, :] < count[:, None], cache.length[:, None] + i[None, :], NO_SLOT)
    return move(cache, src, dst, cache.length + count.astype(jnp.int32), mode=mode)


def commit_ring(
    cache: KVCache,
    src: Int[Array, "b k"],
    count: Int[Array, " b"],
    seen: Int[Array, " b"],
    ring,
    *,
    mode: str = "off",
) -> KVCache:
    """Commit ``count[b]`` block tokens (at slots ``src[b, i]``) into a StreamingLLM ring:
    token i has sequence index ``seen[b] + i`` and goes to ``ring.ring_slot`` of it; the length
    becomes ``min(seen + count, ring.budget)``."""
    i = jnp.arange(src.shape[1], dtype=jnp.int32)[None, :]
    dst = jnp.where(i < count[:, None], ring.ring_slot(seen[:, None] + i), NO_SLOT)
    length = jnp.minimum(seen + count, ring.budget)
    return move(cache, src, dst, length, mode=mode)


def advance(cache: KVCache, count: Int[Array, " b"]) -> KVCache:
    """The first ``count[b]`` block tokens join the prefix where they are (a chain's block)."""
    return dataclasses.replace(cache, length=cache.length + count.astype(jnp.int32))
