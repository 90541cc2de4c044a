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
  ``tree.select_subtree``), sampled children, a greedy draft. Its chance of descending at a node
  is p(children), the most any rule can get from a fixed set of children. SpecExec's rule.
  ``accept_tree_greedy`` is it with one-hot p. Use it for the tree / SwiftSpec engines.
* ``accept_tree_sampled`` (multi-draft rejection, SpecInfer / Sequoia): the children of a node
  must be the first m draws, in draw order, of ``sample_children(key, q[node], k)`` (without
  replacement; with ``replacement=True`` i.i.d. draws, SpecInfer's original), and which draws
  are in the block (m, and the subtree below each) must not depend on the drawn values: a static
  shape (fixed branching per depth, as Sequoia's and SpecInfer's trees). Score-based selection
  of sampled children (top-bs by log q) breaks it, and so do deterministic top-k children: use
  ``accept_tree`` for those. One-hot q (greedy draft) is fine: it yields a single child.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jaxspec.spec.sampling import draw


def residual(p: Float[Array, "*b v"], q: Float[Array, "*b v"]) -> Float[Array, "*b v"]:
    """norm(max(p - q, 0)): where to draw after rejecting a draft of q. Falls back to p when the
    residual is all zero (p <= q everywhere: then p == q and rejection has probability 0)."""
    r = jnp.maximum(p - q, 0.0)
    z = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(z > 0, r / jnp.where(z > 0, z, 1.0), p)


def remove_token(q: Float[Array, "*b v"], x: Int[Array, "*b"]) -> Float[Array, "*b v"]:
    """q with token x removed and renormalised (all zero if nothing is left): the distribution of
    the next draw of sampling without replacement."""
    q = jnp.where(jnp.arange(q.shape[-1]) == x[..., None], 0.0, q)
    z = jnp.sum(q, axis=-1, keepdims=True)
    return q / jnp.where(z > 0, z, 1.0)


def sample_children(
    key: PRNGKeyArray, q: Float[Array, "*b v"], k: int, *, replacement: bool = False
) -> tuple[Int[Array, "*b k"], Float[Array, "*b k"]]:
    """Draw k children from q, in draw order: without replacement (Gumbel-top-k: the ordered
    top k of log q + Gumbel noise is distributed as k sequential draws without replacement) or
    i.i.d. Returns the tokens and their log q (the tree score increments). Draws past q's
    support get log q = -inf, which ``tree.add_children`` drops."""
    logq = jnp.log(q.astype(jnp.float32))
    if replacement:
        tok = jax.random.categorical(
            key, logq[..., None, :], axis=-1, shape=q.shape[:-1] + (k,)
        ).astype(jnp.int32)
    else:
        _, tok = jax.lax.top_k(logq + jax.random.gumbel(key, q.shape, jnp.float32), k)
        tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logq, tok, axis=-1)


def top_children(
    logprobs: Float[Array, "*b v"], k: int
) -> tuple[Int[Array, "*b k"], Float[Array, "*b k"]]:
    """The k most likely tokens and their log-probs, best first (deterministic children; verify
    them with ``accept_tree`` / ``accept_tree_greedy``, never ``accept_tree_sampled``)."""
    val, tok = jax.lax.top_k(logprobs.astype(jnp.float32), k)
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
    next) with next = ``target_tokens`` at the last accepted slot. No randomness."""
    b, t = tokens.shape
    m = t - 1
    rows = jnp.arange(b)
    slots = jnp.arange(t)

    def step(_, st):
        cur, done, n, path = st
        y = target_tokens[rows, cur]
        hit = valid & (slots > 0) & (parent == cur[:, None]) & (tokens == y[:, None])
        hit = hit & ~done[:, None]
        any_hit = jnp.any(hit, axis=1)
        child = jnp.argmax(hit, axis=1).astype(jnp.int32)
        path = path.at[rows, jnp.where(any_hit, n, m)].set(child, mode="drop")
        return (
            jnp.where(any_hit, child, cur),
            done | ~any_hit,
            n + any_hit.astype(jnp.int32),
            path,
        )

    init = (
        jnp.zeros((b,), jnp.int32),
        jnp.zeros((b,), bool),
        jnp.zeros((b,), jnp.int32),
        jnp.full((b, m), -1, jnp.int32),
    )
    cur, _, n, path = jax.lax.fori_loop(0, m, step, init)
    return path, n, target_tokens[rows, cur].astype(jnp.int32)


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


def accept_tree_sampled(
    key: PRNGKeyArray,
    tokens: Int[Array, "b t"],
    parent: Int[Array, "b t"],
    valid: Bool[Array, "b t"],
    p: Float[Array, "b t v"],
    q: Float[Array, "b t v"],
    *,
    replacement: bool = False,
) -> tuple[Int[Array, "b m"], Int[Array, " b"], Int[Array, " b"]]:
    """Multi-draft rejection sampling over a tree of sampled children (SpecInfer's multi-step
    speculative sampling with ``replacement=True``; Sequoia's without-replacement variant by
    default). At the current slot, with P = p[slot], Q = q[slot], try its children x_1, x_2, ...
    in slot (= draw) order: accept x_i with probability min(1, P(x_i) / Q(x_i)) and descend
    (P, Q <- p, q at x_i); on rejection P <- residual(P, Q) and, without replacement,
    Q <- remove_token(Q, x_i). When no child is left, draw the next token from P.

    Lossless only for children drawn as ``sample_children(key, q[slot], k, replacement=...)``
    in a shape fixed before the draws (module docstring). Each slot is tried at most once along
    the walk (tried slots increase), so T static iterations suffice.
    """
    b, t, v = p.shape
    m = t - 1
    rows = jnp.arange(b)
    slots = jnp.arange(t)
    k_u, k_d = jax.random.split(key)

    def step(i, st):
        cur, last, pp, qq, done, n, path = st
        cand = valid & (slots > last[:, None]) & (parent == cur[:, None]) & ~done[:, None]
        has = jnp.any(cand, axis=1)
        child = jnp.argmax(cand, axis=1).astype(jnp.int32)
        x = tokens[rows, child]
        px = jnp.take_along_axis(pp, x[:, None], axis=1)[:, 0]
        qx = jnp.take_along_axis(qq, x[:, None], axis=1)[:, 0]
        u = jax.random.uniform(jax.random.fold_in(k_u, i), (b,), jnp.float32)
        acc = has & (u * qx < px)
        rej = has & ~acc
        pp_rej = residual(pp, qq)
        qq_rej = qq if replacement else remove_token(qq, x)
        pp = jnp.where(acc[:, None], p[rows, child], jnp.where(rej[:, None], pp_rej, pp))
        qq = jnp.where(acc[:, None], q[rows, child], jnp.where(rej[:, None], qq_rej, qq))
        path = path.at[rows, jnp.where(acc, n, m)].set(child, mode="drop")
        return (
            jnp.where(acc, child, cur),
            jnp.where(has, child, last),
            pp,
            qq,
            done | ~has,
            n + acc.astype(jnp.int32),
            path,
        )

    init = (
        jnp.zeros((b,), jnp.int32),
        jnp.zeros((b,), jnp.int32),
        p[:, 0].astype(jnp.float32),
        q[:, 0].astype(jnp.float32),
        jnp.zeros((b,), bool),
        jnp.zeros((b,), jnp.int32),
        jnp.full((b, m), -1, jnp.int32),
    )
    _, _, pp, _, _, n, path = jax.lax.fori_loop(0, t, step, init)
    return path, n, draw(k_d, pp)
