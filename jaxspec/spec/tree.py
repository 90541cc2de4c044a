"""Fixed-capacity token trees, batched: grow, pick the best subtree, lay it out for a forward,
re-root on a verified path.

Every array has the batch first: row b is its own tree. Shapes are static (capacity N), so every
function here jits; loops run only over static sizes.

Nodes and scores
----------------
Node 0 is the root: the last emitted token, whose children are the next-token candidates. Nodes
are appended in order 0..size-1, so a parent's id is always smaller than its child's. A node's
``score`` is the sum of the draft log-probs from the root to it (root 0; unused nodes -inf) and
``depth`` its distance from the root. ``anc[b, i, j]``: node j is an ancestor-or-self of node i.

Slots and positions (the KV convention of every tree forward)
--------------------------------------------------------------
Let ``root_slot[b]`` be the number of committed tokens *before* the root in a cache: the cache's
``length`` when a tree forward runs. Its block window starts at the root:

* Draft tree cache (evolving tree cache): node i, root included, lives at slot
  ``root_slot + i``. Its K/V are there once the node has been *expanded* (the draft ran on it,
  which is what yields its children); a node not yet expanded owns the slot but has nothing in
  it. In terms of a prefix that includes the root, ``L = root_slot + 1``: the root is at slot
  ``L - 1`` and node ``i >= 1`` at block slot ``L + i - 1``. ``expand_layout`` builds that block.
* Target verify block (``verify_layout``): block slot 0 is the root, block slot ``1 + j`` is the
  j-th selected node (selection sorted by node id, so parents come first); slot t sits at cache
  slot ``root_slot + t``. The root is in the block because the target has not run on it yet (it is
  the bonus token of the previous verify); its logits give the distribution of its children.
* RoPE position of a node at depth d: ``root_position + d``. For a dense cache
  ``root_position == root_slot``; a sparse (budgeted) cache keeps true positions while its slots
  are fewer.

After a verify accepted block slots ``path[:n]`` (see ``acceptance``), the target commits the root
and the path: ``verify_commit_src``. The draft re-roots its tree on the bonus token (``reroot``)
and moves the K/V it keeps with one gather (``reroot_kv_src``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxspec import ranking
from jaxspec.model.kv_cache import NO_SLOT, Block
from jaxspec.pytree import pytree_dataclass


@pytree_dataclass
class Tree:
    """A batch of token trees of capacity N (see the module docstring)."""

    token: Int[Array, "b n"]
    parent: Int[Array, "b n"]  # -1 for the root and unused nodes
    depth: Int[Array, "b n"]  # root 0
    score: Float[Array, "b n"]  # cumulative draft log-prob; root 0, unused -inf
    valid: Bool[Array, "b n"]
    size: Int[Array, " b"]  # nodes used: 0..size-1
    anc: Bool[Array, "b n n"]  # anc[b, i, j]: j is an ancestor-or-self of i

    @property
    def batch(self) -> int:
        return self.token.shape[0]

    @property
    def capacity(self) -> int:
        return self.token.shape[1]


@pytree_dataclass
class TreeBlock:
    """The target's verify block for a selected subtree; T = selected + 1 (slot 0 is the root).

    node:    tree node id at each block slot (0 at slot 0, -1 for padding).
    tokens:  token at each slot (0 for padding).
    parent:  block slot of each slot's parent (-1 at slot 0 and for padding).
    valid:   real slots (slot 0 always).
    block:   positions, cache slots (``root_slot + t``; padding not written) and the tree mask
             ``block_mask[b, t, s]``: slot s holds an ancestor-or-self of slot t's node.
    """

    node: Int[Array, "b t"]
    tokens: Int[Array, "b t"]
    parent: Int[Array, "b t"]
    valid: Bool[Array, "b t"]
    block: Block


def _rows(b: int):
    return jnp.arange(b)[:, None]


def new_tree(root_token: Int[Array, " b"], capacity: int) -> Tree:
    """Trees holding only their root (node 0)."""
    b, n = root_token.shape[0], capacity
    first = jnp.arange(n) == 0
    return Tree(
        token=jnp.zeros((b, n), jnp.int32).at[:, 0].set(root_token.astype(jnp.int32)),
        parent=jnp.full((b, n), -1, jnp.int32),
        depth=jnp.zeros((b, n), jnp.int32),
        score=jnp.broadcast_to(jnp.where(first, 0.0, -jnp.inf), (b, n)).astype(jnp.float32),
        valid=jnp.broadcast_to(first, (b, n)),
        size=jnp.ones((b,), jnp.int32),
        anc=jnp.broadcast_to(first[:, None] & first[None, :], (b, n, n)),
    )


def add_children(
    tree: Tree,
    parents: Int[Array, "b w"],
    tokens: Int[Array, "b w k"],
    logprobs: Float[Array, "b w k"],
) -> tuple[Tree, Int[Array, "b w k"]]:
    """Append children ``tokens[b, w, :]`` under node ``parents[b, w]``, parent-major then k.

    A child gets score = parent score + logprob and depth = parent depth + 1. Dropped (new id -1):
    children of parent -1 (skip), of a parent that is not a valid node, with logprob -inf or NaN
    (zero draft probability: a child past the draft's support), and any that would
    exceed the capacity. The kept ones take ids ``size, size + 1, ...`` in that fixed order.
    """
    b, n = tree.token.shape
    w, k = tokens.shape[1:]
    rows = _rows(b)
    par = jnp.broadcast_to(parents[:, :, None], (b, w, k)).reshape(b, w * k).astype(jnp.int32)
    tok = tokens.reshape(b, w * k).astype(jnp.int32)
    lp = logprobs.reshape(b, w * k).astype(jnp.float32)
    pc = jnp.clip(par, 0, n - 1)
    real = (par >= 0) & (par < tree.size[:, None]) & tree.valid[rows, pc] & (lp > -jnp.inf)
    new = tree.size[:, None] + jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1
    real = real & (new < n)
    new = jnp.where(real, new, -1)
    # node i takes child j where new[j] == i: a one-hot match and gathers, not a scatter per
    # field (a GPU runs each scatter as a kernel of its own: seven a call, and a tree round
    # makes several calls)
    hit = new[:, :, None] == jnp.arange(n)[None, None, :]  # [b, w*k, n]; -1 matches nothing
    got = jnp.any(hit, axis=1)
    src = jnp.argmax(hit, axis=1)  # [b, n]: the child each new node takes

    def put(x, v):
        taken = jnp.take_along_axis(v, src, axis=1) if v.ndim == 2 else v
        return jnp.where(got, taken, x)

    anc_new = tree.anc[rows, jnp.take_along_axis(pc, src, axis=1)] | jnp.eye(n, dtype=bool)
    out = Tree(
        token=put(tree.token, tok),
        parent=put(tree.parent, par),
        depth=put(tree.depth, tree.depth[rows, pc] + 1),
        score=put(tree.score, tree.score[rows, pc] + lp),
        valid=tree.valid | got,
        size=tree.size + jnp.sum(real, axis=1, dtype=jnp.int32),
        anc=jnp.where(got[:, :, None], anc_new, tree.anc),
    )
    return out, new.reshape(b, w, k)


def add_path(
    tree: Tree, parent: Int[Array, " b"], tokens: Int[Array, "b d"], logprobs: Float[Array, "b d"]
) -> Tree:
    """Append ``tokens[b, :]`` as a chain under node ``parent[b]``: what ``d`` calls of
    ``add_children`` with one child each (the first under ``parent``, each next under the one
    before) make, as one elementwise update. A child with logprob -inf or NaN is dropped and
    so is everything after it; so is a chain under an invalid parent, and past the capacity."""
    b, n = tree.token.shape
    d = tokens.shape[1]
    rows = jnp.arange(b)
    ids = jnp.arange(n, dtype=jnp.int32)[None, :]
    pc = jnp.clip(parent, 0, n - 1)
    ok = (parent >= 0) & (parent < tree.size) & tree.valid[rows, pc]
    lp = logprobs.astype(jnp.float32)
    keep = jnp.cumprod(lp > -jnp.inf, axis=1).astype(bool) & ok[:, None]  # [b, d]
    count = jnp.sum(keep, axis=1, dtype=jnp.int32)
    rel = ids - tree.size[:, None]  # chain index of node i
    got = (rel >= 0) & (rel < count[:, None])  # ids past n never exist: capacity respected
    rc = jnp.clip(rel, 0, d - 1)
    cum = jnp.cumsum(jnp.where(keep, lp, 0.0), axis=1)
    base_score, base_depth = tree.score[rows, pc], tree.depth[rows, pc]
    par = jnp.where(rel == 0, parent[:, None], ids - 1)
    above = (ids[:, None, :] >= tree.size[:, None, None]) & (ids[:, None, :] <= ids[:, :, None])
    anc_new = tree.anc[rows, pc][:, None, :] | above
    return Tree(
        token=jnp.where(got, jnp.take_along_axis(tokens.astype(jnp.int32), rc, 1), tree.token),
        parent=jnp.where(got, par, tree.parent).astype(jnp.int32),
        depth=jnp.where(got, base_depth[:, None] + 1 + rel, tree.depth).astype(jnp.int32),
        score=jnp.where(got, base_score[:, None] + jnp.take_along_axis(cum, rc, 1), tree.score),
        valid=tree.valid | got,
        size=jnp.minimum(tree.size + count, n),
        anc=jnp.where(got[:, :, None], anc_new, tree.anc),
    )


def best_leaves(tree: Tree, w: int, expanded: Bool[Array, "b n"]) -> Int[Array, "b w"]:
    """The ``w`` highest-score valid nodes not yet expanded, best first (ties: lower id first);
    -1 where there are fewer. These are the nodes the draft runs on next."""
    b, n = tree.token.shape
    cand = tree.valid & ~expanded
    key = jnp.where(cand, tree.score, -jnp.inf)
    kk = min(w, n)
    top_k = ranking.top_k if n <= ranking.MAX_COUNTED else jax.lax.top_k
    _, idx = top_k(key, kk)  # stable: equal scores keep id order
    idx = jnp.where(jnp.take_along_axis(cand, idx, axis=1), idx, -1).astype(jnp.int32)
    if kk < w:
        idx = jnp.concatenate([idx, jnp.full((b, w - kk), -1, jnp.int32)], axis=1)
    return idx


def select_subtree(tree: Tree, bs: int) -> tuple[Int[Array, "b s"], Int[Array, " b"]]:
    """The ``bs`` best non-root nodes, as an ancestor-closed set with the root.

    Order: (effective score desc, depth asc, id asc), where the effective score of a node is the
    minimum score over its non-root ancestors-or-self. With log-probs <= 0 that is the score
    itself; the minimum only guarantees closure for any scores (every ancestor sorts before its
    descendants, ties included). Returns the node ids sorted ascending (parents before children),
    padded with -1, and the count ``min(bs, valid non-root nodes)``.
    """
    b, n = tree.token.shape
    ids = jnp.arange(n, dtype=jnp.int32)
    nonroot = tree.valid & (ids > 0)
    on_path = tree.anc & (ids > 0)[None, None, :]
    eff = jnp.min(jnp.where(on_path, tree.score[:, None, :], jnp.inf), axis=-1)
    k1 = jnp.where(nonroot, -eff, jnp.inf)
    k2 = jnp.where(nonroot, tree.depth, jnp.iinfo(jnp.int32).max)
    kk = min(bs, n)
    count = jnp.minimum(jnp.sum(nonroot, axis=1, dtype=jnp.int32), bs)
    if n <= ranking.MAX_COUNTED:  # the first ``count`` in that order, then by id
        idx = ranking.compact(ranking.ranks(k1, k2) < count[:, None], kk)
    else:
        keys = (k1, k2, jnp.broadcast_to(ids, (b, n)))
        _, _, order = jax.lax.sort(keys, dimension=1, num_keys=3)
        take = jnp.where(jnp.arange(kk) < count[:, None], order[:, :kk], n)
        take = jnp.sort(take, axis=1)
        idx = jnp.where(take < n, take, -1).astype(jnp.int32)
    if kk < bs:
        idx = jnp.concatenate([idx, jnp.full((b, bs - kk), -1, jnp.int32)], axis=1)
    return idx, count


def verify_layout(
    tree: Tree,
    idx: Int[Array, "b s"],
    count: Int[Array, " b"],
    root_slot: Int[Array, " b"],
    root_position: Int[Array, " b"],
) -> TreeBlock:
    """The block the target verifies: the root at slot 0, node ``idx[b, j]`` at slot ``1 + j``
    (``j < count[b]``), T = s + 1 slots.

    positions ``root_position + depth``; cache slots ``root_slot + t`` (padding: not written);
    ``block_mask[b, t, u]``: slot u's node is an ancestor-or-self of slot t's node (padding rows
    and columns false). ``parent`` is the block slot of each node's parent (0 for a child of the
    root; -1 if the parent is not in the block, which cannot happen for ``select_subtree``'s
    ancestor-closed, id-sorted output). Run the target with ``cache.length == root_slot``.
    """
    b, n = tree.token.shape
    s = idx.shape[1]
    t = s + 1
    rows = _rows(b)
    real = (jnp.arange(s) < count[:, None]) & (idx >= 0)
    node = jnp.concatenate(
        [jnp.zeros((b, 1), jnp.int32), jnp.where(real, idx, -1).astype(jnp.int32)], axis=1
    )
    valid = node >= 0
    nc = jnp.clip(node, 0, n - 1)
    tokens = jnp.where(valid, tree.token[rows, nc], 0)
    depth = jnp.where(valid, tree.depth[rows, nc], 0)
    slot_ids = jnp.arange(t, dtype=jnp.int32)
    mask = tree.anc[rows[:, :, None], nc[:, :, None], nc[:, None, :]]
    mask = mask & valid[:, :, None] & valid[:, None, :]
    par_node = tree.parent[rows, nc]
    # the block slot holding each slot's parent node: a match over the block's slots
    holds = (node[:, None, :] == par_node[:, :, None]) & valid[:, None, :]  # [b, t, u]
    parent = jnp.where(
        valid & (par_node >= 0) & jnp.any(holds, axis=2), jnp.argmax(holds, axis=2), -1
    ).astype(jnp.int32)
    block = Block(
        positions=(root_position[:, None] + depth).astype(jnp.int32),
        slots=jnp.where(valid, root_slot[:, None] + slot_ids, NO_SLOT).astype(jnp.int32),
        block_mask=mask,
        appended=True,
    )
    return TreeBlock(node=node, tokens=tokens, parent=parent, valid=valid, block=block)


def expand_layout(
    tree: Tree,
    leaves: Int[Array, "b w"],
    root_slot: Int[Array, " b"],
    root_position: Int[Array, " b"],
) -> tuple[Int[Array, "b w"], Block]:
    """The draft's expansion block: query q runs node ``leaves[b, q]`` (-1: padding, sees nothing,
    writes nothing), its K/V go to slot ``root_slot + leaf``; the block window is the whole tree
    (``block_mask [b, w, N]``: window slot i = node i, visible iff an ancestor-or-self of the
    leaf). The root itself (leaf 0) is expanded this way too. Run the draft with
    ``cache.length == root_slot``; the logits at query q give the children's distribution."""
    b, n = tree.token.shape
    rows = _rows(b)
    real = leaves >= 0
    lc = jnp.clip(leaves, 0, n - 1)
    real = real & tree.valid[rows, lc]
    tokens = jnp.where(real, tree.token[rows, lc], 0)
    depth = jnp.where(real, tree.depth[rows, lc], 0)
    block = Block(
        positions=(root_position[:, None] + depth).astype(jnp.int32),
        slots=jnp.where(real, root_slot[:, None] + lc, NO_SLOT).astype(jnp.int32),
        block_mask=tree.anc[rows, lc] & real[:, :, None],
    )
    return tokens, block


def path_nodes(tb: TreeBlock, path: Int[Array, "b m"]) -> Int[Array, "b m"]:
    """Tree node ids of accepted verify-block slots (-1 stays -1): the ``path`` for ``reroot``."""
    got = jnp.take_along_axis(tb.node, jnp.clip(path, 0, tb.node.shape[1] - 1), axis=1)
    return jnp.where(path >= 0, got, -1)


def verify_commit_src(
    root_slot: Int[Array, " b"], path: Int[Array, "b m"], n_accepted: Int[Array, " b"]
) -> tuple[Int[Array, "b m1"], Int[Array, " b"]]:
    """What the target commits after a verify: the root and the accepted block slots, in order.

    Returns ``(src, count)`` for ``kv_cache.commit`` on the target cache (``length ==
    root_slot``): ``src = root_slot + [0, path[0], ..., path[n-1]]``, ``count = 1 + n``. The new
    ``length`` is then the next root's slot (the bonus token, not yet run)."""
    m = path.shape[1]
    rel = jnp.concatenate([jnp.zeros_like(path[:, :1]), jnp.maximum(path, 0)], axis=1)
    keep = jnp.arange(m + 1) <= n_accepted[:, None]
    src = root_slot[:, None] + jnp.where(keep, rel, 0)
    return src.astype(jnp.int32), (n_accepted + 1).astype(jnp.int32)


def reroot(
    tree: Tree,
    path: Int[Array, "b k"],
    path_len: Int[Array, " b"],
    new_root_token: Int[Array, " b"],
) -> tuple[Tree, Int[Array, "b n"], Int[Array, " b"]]:
    """Re-root each tree after the target accepted nodes ``path[b, :path_len[b]]`` (node ids, a
    chain from a child of the root) and emitted ``new_root_token`` (the bonus).

    Let v be the last accepted node (the root if ``path_len == 0``). If v has a valid child c
    with the bonus token (lowest id if several), c becomes the new root and its subtree is kept,
    compacted in id order (c -> 0), with depths and scores rebased so c has depth 0 and score 0.
    Otherwise the new tree is fresh: just the bonus token at the root.

    Returns ``(tree, keep_src, n_kept)``: ``keep_src[b, i]`` is the old id of new node i (-1 where
    none: unused nodes, and the root of a fresh tree), ``n_kept[b]`` the number of kept old nodes
    (0 for a fresh tree). Per-node side arrays (e.g. ``expanded``) follow with
    ``take_along_axis(x, max(keep_src, 0)) & (keep_src >= 0)``.
    """
    b, n = tree.token.shape
    k = path.shape[1]
    rows = _rows(b)
    ids = jnp.arange(n, dtype=jnp.int32)
    last_i = jnp.clip(path_len - 1, 0, max(k - 1, 0))
    last = (
        jnp.where(path_len > 0, jnp.take_along_axis(path, last_i[:, None], axis=1)[:, 0], 0)
        if k > 0
        else jnp.zeros((b,), jnp.int32)
    )
    is_child = (
        tree.valid
        & (ids > 0)
        & (tree.parent == last[:, None])
        & (tree.token == new_root_token[:, None])
    )
    found = jnp.any(is_child, axis=1)
    c = jnp.argmax(is_child, axis=1).astype(jnp.int32)
    keep = found[:, None] & tree.anc[rows, ids[None, :], c[:, None]] & tree.valid
    new_id = jnp.cumsum(keep, axis=1, dtype=jnp.int32) - 1
    n_kept = jnp.sum(keep, axis=1, dtype=jnp.int32)
    lands = keep[:, None, :] & (new_id[:, None, :] == ids[None, :, None])  # [b, new, old]
    keep_src = jnp.where(jnp.any(lands, axis=2), jnp.argmax(lands, axis=2), -1).astype(jnp.int32)
    ok = keep_src >= 0
    src = jnp.clip(keep_src, 0, n - 1)
    root = ids[None, :] == 0
    old_par = tree.parent[rows, src]
    new_par = jnp.where(
        ok & (ids > 0) & (old_par >= 0), new_id[rows, jnp.clip(old_par, 0, n - 1)], -1
    )
    c_depth = tree.depth[rows, c[:, None]]
    c_score = tree.score[rows, c[:, None]]
    token = jnp.where(ok, tree.token[rows, src], 0)
    token = jnp.where(root & ~found[:, None], new_root_token[:, None], token)
    valid = ok | root
    anc = tree.anc[rows[:, :, None], src[:, :, None], src[:, None, :]] & ok[:, :, None]
    anc = anc & ok[:, None, :]
    anc = anc | (root[:, :, None] & root[:, None, :])
    out = Tree(
        token=token.astype(jnp.int32),
        parent=new_par.astype(jnp.int32),
        depth=jnp.where(ok, tree.depth[rows, src] - c_depth, 0).astype(jnp.int32),
        score=jnp.where(ok, tree.score[rows, src] - c_score, jnp.where(root, 0.0, -jnp.inf)),
        valid=valid,
        size=jnp.maximum(n_kept, 1),
        anc=anc,
    )
    return out, keep_src, n_kept


def reroot_kv_src(
    root_slot: Int[Array, " b"],
    path: Int[Array, "b k"],
    path_len: Int[Array, " b"],
    keep_src: Int[Array, "b n"],
) -> tuple[Int[Array, "b m"], Int[Array, " b"], Int[Array, " b"]]:
    """The draft cache's K/V moves for ``reroot`` (evolving tree cache): one gather, no recompute.

    The old root (slot ``root_slot``) and the accepted nodes become prefix, the kept subtree
    follows with the new root first: new slot ``root_slot + j`` takes old slot ``src[b, j]`` for
    ``j < count[b]``, where the sequence is ``[root, path[0..k-1], keep_src[0..n_kept-1]]`` (old
    node i is at old slot ``root_slot + i``). Apply as
    ``kv_cache.move(cache, src, dst, length)`` with ``reroot_kv_dst``'s destinations (a dense
    cache: new slot ``root_slot + j``; a StreamingLLM ring: the root and path into the ring, the
    kept subtree behind it). ``new_root_slot = root_slot + 1 + path_len`` (dense).

    Nodes never expanded have no K/V to move; the caller must run the draft on them before they
    serve as context: a new root that was not expanded (always the case for a fresh tree), and an
    accepted last path node that was not expanded (a fresh tree's parent; run it together with
    the new root).
    """
    b, k = path.shape
    n = keep_src.shape[1]
    m = 1 + k + n
    kept = keep_src >= 0
    cand = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), path, keep_src], axis=1)
    ok = jnp.concatenate(
        [jnp.ones((b, 1), bool), jnp.arange(k)[None, :] < path_len[:, None], kept], axis=1
    )
    pos = jnp.cumsum(ok, axis=1, dtype=jnp.int32) - 1
    lands = ok[:, None, :] & (pos[:, None, :] == jnp.arange(m)[None, :, None])  # [b, row, cand]
    src = jnp.where(
        jnp.any(lands, axis=2), jnp.take_along_axis(cand, jnp.argmax(lands, axis=2), 1), 0
    ).astype(jnp.int32)
    count = jnp.sum(ok, axis=1, dtype=jnp.int32)
    return (
        (root_slot[:, None] + src).astype(jnp.int32),
        count,
        (root_slot + 1 + path_len).astype(jnp.int32),
    )


def reroot_kv_dst(
    root_slot: Int[Array, " b"],
    root_pos: Int[Array, " b"],
    path_len: Int[Array, " b"],
    count: Int[Array, " b"],
    width: int,
    ring=None,
) -> tuple[Int[Array, "b m"], Int[Array, " b"]]:
    """Where ``reroot_kv_src``'s ``width`` moved rows go, and the cache's new length (the new
    root's slot). Dense (``ring`` None): row j to ``root_slot + j``. A StreamingLLM ring
    (``drafts.Streaming``): the old root and the path (rows ``j <= path_len``, sequence indices
    ``root_pos + j``) to their ring slots, the kept subtree right behind the new length
    ``min(root_pos + 1 + path_len, budget)``, so the tree grown so far survives a re-root in a
    sparse cache as in a dense one. Rows ``j >= count`` go nowhere."""
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    if ring is None:
        dst = root_slot[:, None] + j
        length = root_slot + 1 + path_len
    else:
        length = jnp.minimum(root_pos + 1 + path_len, ring.budget)
        behind = length[:, None] + j - (path_len[:, None] + 1)
        dst = jnp.where(j <= path_len[:, None], ring.ring_slot(root_pos[:, None] + j), behind)
    return jnp.where(j < count[:, None], dst, NO_SLOT).astype(jnp.int32), length.astype(jnp.int32)
