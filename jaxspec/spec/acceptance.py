"""Lossless acceptance rules for speculative decoding: chains and trees, greedy and sampling.

All batched (row b is its own chain or tree), static shapes, jit-friendly. ``p`` and ``q`` are
*processed* distributions (``sampling.probs``: temperature, top-k, top-p), float32, rows summing
to 1. Greedy is a one-hot p; every rule below then needs no randomness and returns exactly the
argmax matches (the ``*_greedy`` variants take argmax token ids instead of [V] rows).

Indexing
--------
Chain: the target ran ``[root, d_0, ..., d_{G-1}]``; ``p[:, i]`` is its distribution for the
token after slot i, so ``p[:, i]`` judges draft token ``d_i`` and ``p[:, G]`` gives the bonus.

Tree: the target ran a verify block of T slots (``tree.verify_layout``): slot 0 is the root,
``parent[b, t]`` is the slot of t's parent (-1 for slot 0 and padding), ``valid`` marks real
slots, siblings appear in increasing slot order. ``p[:, t]`` (and ``q[:, t]``) is the target's
(draft's) distribution of the children of slot t. Rules return ``(path [B, T-1], n [B], next
[B])``: the accepted block slots in root-to-leaf order (padded -1), their number, and the next
token (the bonus, or the correction drawn at the first rejection). The emitted tokens are
``tokens[path[:n]]`` followed by ``next``.

Which rule for which tree
-------------------------
* ``accept_tree`` (draw y ~ p at the current node; descend into the child whose token is y;
  else emit y). Lossless for ANY tree whose tokens do not depend on the target's draw: top-k
  children (``top_children``), dynamic score-based growth and selection (``tree.best_leaves``,
  ``tree.select_subtree``), a greedy draft. Its chance of descending at a node is p(children),
  the most any rule can get from a fixed set of children. SpecExec's rule. ``accept_tree_greedy``
  is it with one-hot p. Every tree engine uses it: their trees are top-k children grown
  best-first, for which multi-draft rejection (SpecInfer / Sequoia, which needs sampled children
  in a shape fixed before the draws) would not be lossless.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jaxspec.model import tensor_parallel
from jaxspec.spec.sampling import draw


def residual(p: Float[Array, "*b v"], q: Float[Array, "*b v"]) -> Float[Array, "*b v"]:
    """norm(max(p - q, 0)): where to draw after rejecting a draft of q. Falls back to p when the
    residual is all zero (p <= q everywhere: then p == q and rejection has probability 0)."""
    r = jnp.maximum(p - q, 0.0)
    z = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(z > 0, r / jnp.where(z > 0, z, 1.0), p)


def top_children(
    logprobs: Float[Array, "*b v"], k: int
) -> tuple[Int[Array, "*b k"], Float[Array, "*b k"]]:
    """The k most likely tokens and their log-probs, best first (deterministic children; verify
    them with ``accept_tree`` / ``accept_tree_greedy``)."""
    val, tok = tensor_parallel.top_k(logprobs.astype(jnp.float32), k)
    return tok.astype(jnp.int32), val


# ----------------------------------------------------------------------------------------------
# Chain


def _chain_limit(match: Bool[Array, "b g"], n_draft) -> Bool[Array, "b g"]:
    if n_draft is None:
        return match
    return match & (jnp.arange(match.shape[1]) < n_draft[:, None])


def accept_chain_greedy(
    draft_tokens: Int[Array, "b g"],
    target_tokens: Int[Array, "b g1"],
    n_draft: Int[Array, " b"] | None = None,
) -> tuple[Int[Array, " b"], Int[Array, " b"]]:
    """Greedy chain: ``target_tokens[:, i]`` is the target's argmax after slot i. Accepts the
    longest prefix with ``draft_tokens[:, i] == target_tokens[:, i]`` (at most ``n_draft[b]``
    drafts, default all G); next token = ``target_tokens[:, n]``. No randomness."""
    match = _chain_limit(draft_tokens == target_tokens[:, :-1], n_draft)
    n = jnp.sum(jnp.cumprod(match, axis=1), axis=1, dtype=jnp.int32)
    nxt = jnp.take_along_axis(target_tokens, n[:, None], axis=1)[:, 0]
    return n, nxt.astype(jnp.int32)


def accept_chain(
    key: PRNGKeyArray,
    draft_tokens: Int[Array, "b g"],
    q: Float[Array, "b g v"],
    p: Float[Array, "b g1 v"],
    n_draft: Int[Array, " b"] | None = None,
) -> tuple[Int[Array, " b"], Int[Array, " b"]]:
    """Speculative sampling (Leviathan et al.; Chen et al.). ``draft_tokens[:, i] ~ q[:, i]``;
    ``p`` has G + 1 rows (the last for the bonus). Accept d_i with probability
    min(1, p_i(d_i) / q_i(d_i)) while all before were accepted (and i < n_draft[b]); at the first
    rejection i draw the next token from ``residual(p_i, q_i)``; if all are accepted, from
    ``p[:, n]``. Returns ``(n_accepted, next_token)``. The emitted tokens are ``d[:n] + [next]``,
    distributed exactly as the target's. One-hot p gives exactly ``accept_chain_greedy``."""
    b, g = draft_tokens.shape
    if g == 0:
        return jnp.zeros((b,), jnp.int32), draw(key, p[:, 0])
    k_u, k_d = jax.random.split(key)
    d = draft_tokens[..., None]
    px = jnp.take_along_axis(p[:, :g], d, axis=-1)[..., 0]
    qx = jnp.take_along_axis(q, d, axis=-1)[..., 0]
    u = jax.random.uniform(k_u, (b, g), jnp.float32)
    acc = _chain_limit(u * qx < px, n_draft)  # u < p/q without dividing; u in [0, 1)
    n = jnp.sum(jnp.cumprod(acc, axis=1), axis=1, dtype=jnp.int32)
    rows = jnp.arange(b)
    p_n = p[rows, n]
    q_n = q[rows, jnp.minimum(n, g - 1)]
    limit = jnp.full((b,), g, jnp.int32) if n_draft is None else jnp.minimum(n_draft, g)
    dist = jnp.where((n >= limit)[:, None], p_n, residual(p_n, q_n))
    return n, draw(k_d, dist)


# ----------------------------------------------------------------------------------------------
# Tree


def accept_tree_greedy(
    tokens: Int[Array, "b t"],
    parent: Int[Array, "b t"],
    valid: Bool[Array, "b t"],
    target_tokens: Int[Array, "b t"],
) -> tuple[Int[Array, "b m"], Int[Array, " b"], Int[Array, " b"]]:
    """Walk from the root: at slot c descend into the (lowest-slot) valid child whose token is
    ``target_tokens[:, c]`` (the target's argmax after c); stop when none. Returns (path, n,
    next) with next = ``target_tokens`` at the last accepted slot. No randomness.

    Computed without a loop over the walk's steps (a GPU ran each step as a few kernels of its
    own): slot j *matches* when its token is the target's argmax after its parent, and no
    lower slot under the same parent matches; the walk reaches j exactly when j and all its
    ancestors match, which ``log2(t)`` pointer-jumping steps over the parents decide, together
    with j's depth (its place on the path)."""
    b, t = tokens.shape
    m = t - 1
    slots = jnp.arange(t, dtype=jnp.int32)
    pc = jnp.clip(parent, 0, t - 1)
    match = (
        valid
        & (slots > 0)
        & (parent >= 0)
        & (tokens == jnp.take_along_axis(target_tokens, pc, axis=1))
    )
    same = (pc[:, None, :] == pc[:, :, None]) & (slots[None, :] < slots[:, None])  # [b, j, i]
    match = match & ~jnp.any(same & match[:, None, :], axis=2)
    # pointer jumping: ``ok`` = every slot from j up to (not including) ``up`` matches; ``depth``
    # = the slots in between; ``up`` jumps to its own ``up`` until it is the root
    ok = match | (slots == 0)
    depth = (slots > 0).astype(jnp.int32) * jnp.ones((b, 1), jnp.int32)
    up = jnp.where(slots > 0, pc, 0)
    for _ in range(max(1, (t - 1).bit_length())):
        ok = ok & jnp.take_along_axis(ok, up, axis=1)
        depth = depth + jnp.take_along_axis(depth, up, axis=1)
        up = jnp.take_along_axis(up, up, axis=1)
    on = ok & (slots > 0)  # on the accepted path
    n = jnp.sum(on, axis=1, dtype=jnp.int32)
    at = on[:, None, :] & (depth[:, None, :] == jnp.arange(1, m + 1)[None, :, None])  # [b, m, t]
    path = jnp.where(jnp.any(at, axis=2), jnp.argmax(at, axis=2), -1).astype(jnp.int32)
    last = jnp.max(jnp.where(on & (depth == n[:, None]), slots, 0), axis=1)
    nxt = jnp.take_along_axis(target_tokens, last[:, None], axis=1)[:, 0]
    return path, n, nxt.astype(jnp.int32)


def accept_tree(
    key: PRNGKeyArray,
    tokens: Int[Array, "b t"],
    parent: Int[Array, "b t"],
    valid: Bool[Array, "b t"],
    p: Float[Array, "b t v"],
) -> tuple[Int[Array, "b m"], Int[Array, " b"], Int[Array, " b"]]:
    """Lossless for any tree (see the module docstring): draw y_t ~ p[:, t] independently at
    every slot and walk as ``accept_tree_greedy`` with those draws. Each emitted token is the
    target's own draw at its context, so the output is distributed exactly as the target's."""
    return accept_tree_greedy(tokens, parent, valid, draw(key, p))
