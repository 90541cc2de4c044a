"""Top-k and ordered selection over short rows by counting, not sorting.

A tree round selects from short rows several times: the leaves to expand next (of ~129 nodes),
the subtree to verify (the same nodes, by three keys), the best children among each chunk's
best (192 candidates). ``lax.top_k`` and ``lax.sort`` run each of those as a sort kernel of its
own on a GPU. Here an entry's rank is the number of entries that order before it, from one
pairwise comparison of the row with itself (``n * n`` comparisons, reduced as they are made),
and the k entries of rank below k are gathered by a one-hot match: elementwise work and
reductions that XLA fuses with their neighbours. Meant for rows of at most a few hundred.

The results equal ``lax.top_k``'s and a stable lexicographic sort's, ties included (the lower
index first). NaN is not ordered: callers pass keys without it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

MAX_COUNTED = 512  # longer rows: lax.top_k (the pairwise comparison grows as n * n)


def ranks(*keys: Array) -> Int[Array, "*b n"]:
    """Each entry's place in the ascending lexicographic order of ``keys`` (each ``[*b, n]``;
    ties of every key: the lower index first): a permutation of ``0..n-1`` per row."""
    n = keys[0].shape[-1]
    i = jnp.arange(n)
    before = i[None, :] < i[:, None]  # [i, j]: j's index is lower than i's
    for key in reversed(keys):  # the last key breaks ties first, so it is folded in first
        a, b = key[..., :, None], key[..., None, :]  # [*b, i, j]: entry i against entry j
        before = (b < a) | ((b == a) & before)
    return jnp.sum(before, axis=-1, dtype=jnp.int32)


def first_by_rank(rank: Int[Array, "*b n"], k: int) -> Int[Array, "*b k"]:
    """The indices of the entries of rank ``0..k-1``, in that order (``k <= n``)."""
    n = rank.shape[-1]
    hit = rank[..., None, :] == jnp.arange(k, dtype=rank.dtype)[:, None]  # [*b, k, n]
    return jnp.sum(jnp.where(hit, jnp.arange(n, dtype=jnp.int32), 0), axis=-1, dtype=jnp.int32)


def top_k(x: Float[Array, "*b n"], k: int) -> tuple[Float[Array, "*b k"], Int[Array, "*b k"]]:
    """``lax.top_k(x, k)``: the k largest entries, best first, ties lower index first."""
    idx = first_by_rank(ranks(-x), k)
    return jnp.take_along_axis(x, idx, axis=-1), idx


def compact(keep: Bool[Array, "*b n"], k: int) -> Int[Array, "*b k"]:
    """The indices where ``keep`` holds, ascending, in the first ``k`` places; -1 after them."""
    place = jnp.where(keep, jnp.cumsum(keep, axis=-1, dtype=jnp.int32) - 1, -1)
    n = keep.shape[-1]
    hit = place[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]  # [*b, k, n]
    found = jnp.any(hit, axis=-1)
    idx = jnp.sum(jnp.where(hit, jnp.arange(n, dtype=jnp.int32), 0), axis=-1, dtype=jnp.int32)
    return jnp.where(found, idx, -1)
