"""Tree attention for speculative verification: T <= 64 tree queries over a long prefix.

The decode kernel already takes an arbitrary ``block_mask`` (ancestor-closed tree masks
included) for up to 64 queries per row and 128 block slots, with the prefix done by split-K
flash-decoding and the tree block merged by log-sum-exp. This module is its named entry point.
"""

from __future__ import annotations

from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.decode_attention import decode_attention, reference


def tree_attention(
    q: Float[Array, "b t h hd"],
    k: Float[Array, "b s kh hd"],
    v: Float[Array, "b s kh hd"],
    length: Int[Array, " b"],
    tree_mask: Bool[Array, "b t n"],
    *,
    interpret: bool = False,
    **tuning,
) -> Float[Array, "b t h hd"]:
    """Attention of T tree nodes: every prefix slot plus the block slots ``tree_mask`` allows
    (node t sees slot ``length[b] + j`` iff ``tree_mask[b, t, j]``, usually its ancestors and
    itself). ``tuning``: ``k_splits``, ``block_k``, ``block_m``, ``num_warps``, ``num_stages``."""
    return decode_attention(q, k, v, length, tree_mask, interpret=interpret, **tuning)


tree_attention_reference = reference
