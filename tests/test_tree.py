"""Token trees: exact results on hand-built trees, randomized invariants, and the slot convention
end to end with a real (tiny) model: tree forwards and re-rooted K/V give full-forward logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.model.kv_cache import causal_block, commit, init_cache, move
from jaxspec.model.transformer import apply, new_model
from jaxspec.spec import drafts
from jaxspec.spec import tree as T
from jaxspec.spec.acceptance import accept_tree_greedy, top_children

# ------------------------------------------------------------------------------------------------
# The hand-built tree (capacity 10), row 0:
#
#   0 (tok 100)
#   |- 1 (10, -0.5)  |- 4 (20, -0.75) |- 7 (40, -1.25)
#   |                |                `- 8 (41, -1.75)
#   |                `- 5 (21, -2.0)
#   |- 2 (11, -1.0)  `- 9 (50, -1.25)
#   `- 3 (12, -2.0)  `- 6 (30, -2.125)
#
# Row 1 is a small different tree: 0 (tok 200) - 1 (60, -1.0) - 2 (61, -1.5).

HAND_PARENT = [-1, 0, 0, 0, 1, 1, 3, 4, 4, 2]
HAND_TOKEN = [100, 10, 11, 12, 20, 21, 30, 40, 41, 50]
HAND_SCORE = [0.0, -0.5, -1.0, -2.0, -0.75, -2.0, -2.125, -1.25, -1.75, -1.25]
HAND_DEPTH = [0, 1, 1, 1, 2, 2, 2, 3, 3, 2]
HAND_ANC = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 3], 4: [0, 1, 4], 5: [0, 1, 5], 6: [0, 3, 6]}
HAND_ANC.update({7: [0, 1, 4, 7], 8: [0, 1, 4, 8], 9: [0, 2, 9]})
NINF = -np.inf

# jitted once per shape for the whole file (eager dispatch compiles every primitive: slow on CPU)
new_tree = jax.jit(T.new_tree, static_argnums=1)
add_children = jax.jit(T.add_children)
best_leaves = jax.jit(T.best_leaves, static_argnums=1)
select_subtree = jax.jit(T.select_subtree, static_argnums=1)
verify_layout = jax.jit(T.verify_layout)
expand_layout = jax.jit(T.expand_layout)
reroot = jax.jit(T.reroot)
reroot_kv_src = jax.jit(T.reroot_kv_src)
reroot_kv_dst = jax.jit(T.reroot_kv_dst, static_argnums=(4, 5))
verify_commit_src = jax.jit(T.verify_commit_src)
path_nodes = jax.jit(T.path_nodes)
children_of = jax.jit(lambda logits: top_children(jax.nn.log_softmax(logits), 2))
greedy_walk = jax.jit(
    lambda tb, logits: accept_tree_greedy(tb.tokens, tb.parent, tb.valid, jnp.argmax(logits, -1))
)


def mark(expanded, leaves):
    """expanded | leaves (numpy; -1 leaves ignored)."""
    out = np.array(expanded, bool)
    for r, row in enumerate(np.asarray(leaves)):
        out[r, row[row >= 0]] = True
    return out


def anc_matrix(lists, n):
    a = np.zeros((n, n), bool)
    for i, js in lists.items():
        a[i, js] = True
    return a


def hand_tree():
    tr = new_tree(jnp.array([100, 200]), 10)
    tr, ids1 = add_children(
        tr,
        jnp.array([[0], [0]]),
        jnp.array([[[10, 11, 12]], [[60, 99, 98]]]),
        jnp.array([[[-0.5, -1.0, -2.0]], [[-1.0, NINF, NINF]]]),  # -inf children are dropped
    )
    tr, ids2 = add_children(
        tr,
        jnp.array([[1, 3], [1, -1]]),
        jnp.array([[[20, 21], [30, 31]], [[61, 62], [63, 64]]]),
        jnp.array([[[-0.25, -1.5], [-0.125, NINF]], [[-0.5, NINF], [-0.1, -0.1]]]),
    )
    # parent -1 skipped; the last child of row 0 does not fit (capacity 10)
    tr, ids3 = add_children(
        tr,
        jnp.array([[4, -1, 2], [7, 1, 1]]),  # row 1: node 7 does not exist -> dropped
        jnp.array([[[40, 41], [0, 0], [50, 51]], [[1, 1], [2, 2], [3, 3]]]),
        jnp.array(
            [[[-0.5, -1.0], [0.0, 0.0], [-0.25, -3.0]], [[0, 0], [NINF, NINF], [NINF, NINF]]]
        ),
    )
    return tr, (ids1, ids2, ids3)


def test_new_tree():
    tr = new_tree(jnp.array([5, 6, 7], jnp.int32), 4)
    np.testing.assert_array_equal(tr.token[:, 0], [5, 6, 7])
    np.testing.assert_array_equal(tr.parent, -np.ones((3, 4)))
    np.testing.assert_array_equal(tr.valid, np.broadcast_to([True, False, False, False], (3, 4)))
    np.testing.assert_array_equal(tr.size, [1, 1, 1])
    np.testing.assert_array_equal(tr.score[0], [0.0, NINF, NINF, NINF])
    np.testing.assert_array_equal(tr.anc[1], anc_matrix({0: [0]}, 4))


def test_add_children_hand_tree():
    tr, (ids1, ids2, ids3) = hand_tree()
    np.testing.assert_array_equal(ids1, [[[1, 2, 3]], [[1, -1, -1]]])
    np.testing.assert_array_equal(ids2, [[[4, 5], [6, -1]], [[2, -1], [-1, -1]]])
    np.testing.assert_array_equal(ids3[0], [[7, 8], [-1, -1], [9, -1]])
    np.testing.assert_array_equal(ids3[1], -np.ones((3, 2)))
    np.testing.assert_array_equal(tr.size, [10, 3])
    np.testing.assert_array_equal(tr.token[0], HAND_TOKEN)
    np.testing.assert_array_equal(tr.parent[0], HAND_PARENT)
    np.testing.assert_array_equal(tr.depth[0], HAND_DEPTH)
    np.testing.assert_array_equal(tr.score[0], HAND_SCORE)
    np.testing.assert_array_equal(tr.valid[0], np.ones(10, bool))
    np.testing.assert_array_equal(tr.anc[0], anc_matrix(HAND_ANC, 10))
    # row 1
    np.testing.assert_array_equal(tr.token[1, :3], [200, 60, 61])
    np.testing.assert_array_equal(tr.parent[1], [-1, 0, 1] + [-1] * 7)
    np.testing.assert_array_equal(tr.depth[1, :3], [0, 1, 2])
    np.testing.assert_array_equal(tr.score[1], [0.0, -1.0, -1.5] + [NINF] * 7)
    np.testing.assert_array_equal(tr.valid[1], [True] * 3 + [False] * 7)
    np.testing.assert_array_equal(tr.anc[1], anc_matrix({0: [0], 1: [0, 1], 2: [0, 1, 2]}, 10))


def test_add_children_jits():
    tr, _ = hand_tree()
    f = add_children
    t0 = new_tree(jnp.array([100, 200]), 10)
    a, ia = f(t0, jnp.array([[0], [0]]), jnp.ones((2, 1, 2), jnp.int32), jnp.zeros((2, 1, 2)))
    b, ib = add_children(
        t0, jnp.array([[0], [0]]), jnp.ones((2, 1, 2), jnp.int32), jnp.zeros((2, 1, 2))
    )
    for x, y in zip(jax.tree.leaves((a, ia)), jax.tree.leaves((b, ib)), strict=True):
        np.testing.assert_array_equal(x, y)


def test_best_leaves():
    tr, _ = hand_tree()
    expanded = np.zeros((2, 10), bool)
    expanded[0, [0, 1, 3, 4]] = True
    expanded[1, 0] = True
    got = best_leaves(tr, 4, expanded)
    # row 0 candidates: 2 (-1), 5 (-2), 6 (-2.125), 7 (-1.25), 8 (-1.75), 9 (-1.25): tie 7/9 -> 7
    np.testing.assert_array_equal(got[0], [2, 7, 9, 8])
    np.testing.assert_array_equal(got[1], [1, 2, -1, -1])
    got = best_leaves(tr, 12, expanded)  # w > capacity
    np.testing.assert_array_equal(got[0], [2, 7, 9, 8, 5, 6] + [-1] * 6)
    # equal scores: lower id first
    t = new_tree(jnp.array([1]), 6)
    t, _ = add_children(t, jnp.array([[0]]), jnp.array([[[5, 6, 7, 8]]]), jnp.full((1, 1, 4), -1.0))
    np.testing.assert_array_equal(best_leaves(t, 3, np.arange(6)[None] < 2), [[2, 3, 4]])


def test_select_subtree_hand():
    tr, _ = hand_tree()
    sel = select_subtree
    # order: 1, 4, 2, 9 (-1.25, depth 2), 7 (-1.25, depth 3), 8, 3 (-2, d1), 5 (-2, d2), 6
    idx, count = sel(tr, 5)
    np.testing.assert_array_equal(idx[0], [1, 2, 4, 7, 9])
    np.testing.assert_array_equal(idx[1], [1, 2, -1, -1, -1])
    np.testing.assert_array_equal(count, [5, 2])
    idx, count = sel(tr, 7)
    np.testing.assert_array_equal(idx[0], [1, 2, 3, 4, 7, 8, 9])
    idx, count = sel(tr, 12)
    np.testing.assert_array_equal(idx[0], list(range(1, 10)) + [-1] * 3)
    np.testing.assert_array_equal(count, [9, 2])


def test_select_subtree_ties_and_rising_scores_stay_closed():
    # zero log-probs: a (0) - b (0), c (-1): equal scores, the parent first
    t = new_tree(jnp.array([1]), 6)
    t, _ = add_children(t, jnp.array([[0]]), jnp.array([[[5, 6]]]), jnp.array([[[0.0, -1.0]]]))
    t, _ = add_children(t, jnp.array([[1]]), jnp.array([[[7]]]), jnp.array([[[0.0]]]))
    idx, count = select_subtree(t, 2)
    np.testing.assert_array_equal(idx, [[1, 3]])
    # a "log-prob" > 0 (not a probability; e.g. a bonus term): the child must not come first
    t = new_tree(jnp.array([1]), 6)
    t, _ = add_children(t, jnp.array([[0]]), jnp.array([[[5, 6]]]), jnp.array([[[-1.0, -0.7]]]))
    t, _ = add_children(t, jnp.array([[1]]), jnp.array([[[7]]]), jnp.array([[[0.5]]]))
    for bs, want in [(1, [2]), (2, [1, 2]), (3, [1, 2, 3])]:
        idx, count = select_subtree(t, bs)
        np.testing.assert_array_equal(idx, [want])


def test_verify_layout_hand():
    tr, _ = hand_tree()
    idx, count = select_subtree(tr, 5)
    tb = verify_layout(tr, idx, count, jnp.array([20, 3]), jnp.array([33, 7]))
    np.testing.assert_array_equal(tb.node[0], [0, 1, 2, 4, 7, 9])
    np.testing.assert_array_equal(tb.tokens[0], [100, 10, 11, 20, 40, 50])
    np.testing.assert_array_equal(tb.parent[0], [-1, 0, 0, 1, 3, 2])
    np.testing.assert_array_equal(tb.valid[0], [True] * 6)
    np.testing.assert_array_equal(tb.block.positions[0], 33 + np.array([0, 1, 1, 2, 3, 2]))
    np.testing.assert_array_equal(tb.block.slots[0], 20 + np.arange(6))
    want = anc_matrix(
        {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 3, 4], 5: [0, 2, 5]}, 6
    )
    np.testing.assert_array_equal(tb.block.block_mask[0], want)
    # row 1: two nodes and padding
    np.testing.assert_array_equal(tb.node[1], [0, 1, 2, -1, -1, -1])
    np.testing.assert_array_equal(tb.tokens[1], [200, 60, 61, 0, 0, 0])
    np.testing.assert_array_equal(tb.parent[1], [-1, 0, 1, -1, -1, -1])
    np.testing.assert_array_equal(tb.valid[1], [True] * 3 + [False] * 3)
    np.testing.assert_array_equal(tb.block.positions[1, :3], [7, 8, 9])
    np.testing.assert_array_equal(tb.block.slots[1], [3, 4, 5] + [T.NO_SLOT] * 3)
    np.testing.assert_array_equal(
        tb.block.block_mask[1], anc_matrix({0: [0], 1: [0, 1], 2: [0, 1, 2]}, 6)
    )
    # a shorter count pads the rest
    tb = verify_layout(tr, idx, jnp.array([2, 2]), jnp.array([20, 3]), jnp.array([33, 7]))
    np.testing.assert_array_equal(tb.node[0], [0, 1, 2, -1, -1, -1])
    assert not tb.block.block_mask[0, 3:].any() and not tb.block.block_mask[0, :, 3:].any()
    np.testing.assert_array_equal(path_nodes(tb, jnp.array([[1, -1], [2, -1]])), [[1, -1], [2, -1]])


def test_expand_layout_hand():
    tr, _ = hand_tree()
    tokens, blk = expand_layout(
        tr, jnp.array([[0, 7, -1], [2, -1, -1]]), jnp.array([20, 3]), jnp.array([33, 7])
    )
    np.testing.assert_array_equal(tokens, [[100, 40, 0], [61, 0, 0]])
    np.testing.assert_array_equal(blk.slots, [[20, 27, T.NO_SLOT], [5, T.NO_SLOT, T.NO_SLOT]])
    np.testing.assert_array_equal(blk.positions[0, :2], [33, 36])
    np.testing.assert_array_equal(blk.positions[1, 0], 9)
    a = anc_matrix(HAND_ANC, 10)
    np.testing.assert_array_equal(blk.block_mask[0], np.stack([a[0], a[7], np.zeros(10, bool)]))
    np.testing.assert_array_equal(blk.block_mask[1, 0], [True, True, True] + [False] * 7)
    assert not blk.block_mask[1, 1:].any()


def test_verify_commit_src():
    src, count = verify_commit_src(
        jnp.array([20, 3]), jnp.array([[1, 3, 4], [-1, -1, -1]]), jnp.array([3, 0])
    )
    np.testing.assert_array_equal(src[0], [20, 21, 23, 24])
    np.testing.assert_array_equal(src[1, :1], [3])
    np.testing.assert_array_equal(count, [4, 1])


def test_reroot_hand():
    tr, _ = hand_tree()
    rr = reroot
    # row 0: path 1 -> bonus 20 (node 4): keep {4, 7, 8}; row 1: path [] -> bonus 60 (node 1)
    new, keep_src, n_kept = rr(
        tr, jnp.array([[1, -1], [-1, -1]]), jnp.array([1, 0]), jnp.array([20, 60])
    )
    np.testing.assert_array_equal(n_kept, [3, 2])
    np.testing.assert_array_equal(keep_src[0], [4, 7, 8] + [-1] * 7)
    np.testing.assert_array_equal(keep_src[1], [1, 2] + [-1] * 8)
    np.testing.assert_array_equal(new.size, [3, 2])
    np.testing.assert_array_equal(new.token[0, :3], [20, 40, 41])
    np.testing.assert_array_equal(new.parent[0], [-1, 0, 0] + [-1] * 7)
    np.testing.assert_array_equal(new.depth[0, :3], [0, 1, 1])
    np.testing.assert_array_equal(new.score[0], [0.0, -0.5, -1.0] + [NINF] * 7)
    np.testing.assert_array_equal(new.valid[0], [True] * 3 + [False] * 7)
    np.testing.assert_array_equal(new.anc[0], anc_matrix({0: [0], 1: [0, 1], 2: [0, 2]}, 10))
    np.testing.assert_array_equal(new.token[1, :2], [60, 61])
    np.testing.assert_array_equal(new.score[1, :2], [0.0, -0.5])
    np.testing.assert_array_equal(new.anc[1], anc_matrix({0: [0], 1: [0, 1]}, 10))
    src, count, new_root_slot = reroot_kv_src(
        jnp.array([20, 3]), jnp.array([[1, -1], [-1, -1]]), jnp.array([1, 0]), keep_src
    )
    np.testing.assert_array_equal(count, [5, 3])
    np.testing.assert_array_equal(src[0, :5], 20 + np.array([0, 1, 4, 7, 8]))
    np.testing.assert_array_equal(src[1, :3], 3 + np.array([0, 1, 2]))
    np.testing.assert_array_equal(new_root_slot, [22, 3 + 1])

    # path 2 -> 9 (leaf) and bonus 0 / row 1: path 1 -> 2, bonus 61 is not a child of 2: fresh
    new, keep_src, n_kept = rr(
        tr, jnp.array([[2, 9], [1, 2]]), jnp.array([2, 2]), jnp.array([7, 61])
    )
    np.testing.assert_array_equal(n_kept, [0, 0])
    np.testing.assert_array_equal(keep_src, -np.ones((2, 10)))
    np.testing.assert_array_equal(new.token[:, 0], [7, 61])
    np.testing.assert_array_equal(new.size, [1, 1])
    fresh = new_tree(jnp.array([7, 61]), 10)
    for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(x, y)
    src, count, new_root_slot = reroot_kv_src(
        jnp.array([20, 3]), jnp.array([[2, 9], [1, 2]]), jnp.array([2, 2]), keep_src
    )
    np.testing.assert_array_equal(count, [3, 3])
    np.testing.assert_array_equal(src[0, :3], [20, 22, 29])
    np.testing.assert_array_equal(new_root_slot, [23, 6])

    # a token of the tree that is not a child of the last accepted node: fresh
    new, keep_src, n_kept = reroot(
        tr, jnp.array([[1], [1]]), jnp.array([1, 1]), jnp.array([50, 60])
    )
    np.testing.assert_array_equal(n_kept, [0, 0])
    # deeper: path 1, 4 -> bonus 40 (node 7, a leaf) -> a one-node kept tree
    new, keep_src, n_kept = reroot(
        tr, jnp.array([[1, 4], [1, 2]]), jnp.array([2, 1]), jnp.array([40, 61])
    )
    np.testing.assert_array_equal(n_kept, [1, 1])
    np.testing.assert_array_equal(keep_src[:, :2], [[7, -1], [2, -1]])
    np.testing.assert_array_equal(new.token[:, 0], [40, 61])


def test_reroot_kv_dst_dense_and_ring():
    """Where a re-root's moved K/V rows go: a dense cache keeps them in order from the old root's
    slot; a StreamingLLM ring (2 sinks + 6) puts the old root and the accepted path at their
    sequence indices' ring slots and the kept subtree right behind the new length, so a sparse
    tree cache keeps the tree it grew as a dense one does. Rows past ``count`` go nowhere."""
    # row 0: root at slot 5 = sequence index 5, 1 accepted node, 2 kept (count 4)
    # row 1: a full ring (slot 8), root at index 20, 2 accepted nodes, 1 kept (count 4)
    root_slot, root_pos = jnp.array([5, 8]), jnp.array([5, 20])
    path_len, count = jnp.array([1, 2]), jnp.array([4, 4])
    dst, length = reroot_kv_dst(root_slot, root_pos, path_len, count, 5, None)
    np.testing.assert_array_equal(dst, [[5, 6, 7, 8, T.NO_SLOT], [8, 9, 10, 11, T.NO_SLOT]])
    np.testing.assert_array_equal(length, [7, 11])
    ring = drafts.Streaming(sinks=2, window=6)
    dst, length = reroot_kv_dst(root_slot, root_pos, path_len, count, 5, ring)
    # ring_slot(j) = j below the budget 8, else 2 + (j - 2) % 6: 20 -> 2, 21 -> 3, 22 -> 4
    np.testing.assert_array_equal(dst, [[5, 6, 7, 8, T.NO_SLOT], [2, 3, 4, 8, T.NO_SLOT]])
    np.testing.assert_array_equal(length, [7, 8])


def test_reroot_duplicate_sibling_tokens_pick_lowest_id():
    t = new_tree(jnp.array([1]), 8)
    t, _ = add_children(
        t, jnp.array([[0]]), jnp.array([[[5, 5, 6]]]), jnp.array([[[-1.0, -2.0, -3.0]]])
    )
    t, _ = add_children(t, jnp.array([[2]]), jnp.array([[[7]]]), jnp.array([[[-1.0]]]))
    new, keep_src, n_kept = reroot(t, jnp.zeros((1, 0), jnp.int32), jnp.array([0]), jnp.array([5]))
    np.testing.assert_array_equal(keep_src[0, :2], [1, -1])
    new, keep_src, n_kept = reroot(t, jnp.zeros((1, 0), jnp.int32), jnp.array([0]), jnp.array([6]))
    np.testing.assert_array_equal(n_kept, [1])


# ------------------------------------------------------------------------------------------------
# Randomized invariants


def random_tree(seed, b=4, n=24, rounds=6, w=3, k=3, vocab=5):
    """A random tree grown the way an engine grows one (best leaves, k children each), with a
    small vocabulary (duplicate siblings) and coarse log-probs (ties, zeros)."""
    rng = np.random.RandomState(seed)
    tr = new_tree(jnp.asarray(rng.randint(0, vocab, b)), n)
    expanded = np.zeros((b, n), bool)
    for _ in range(rounds):
        leaves = best_leaves(tr, w, expanded)
        tokens = jnp.asarray(rng.randint(0, vocab, (b, w, k)))
        lp = jnp.asarray(-rng.choice([0.0, 0.5, 1.0, 1.5, 3.0], (b, w, k)), jnp.float32)
        tr, _ = add_children(tr, leaves, tokens, lp)
        expanded = mark(expanded, leaves)
    return tr


def check_consistent(tr, row):
    """parent / depth / anc / valid agree; parents before children."""
    size = int(tr.size[row])
    par = np.asarray(tr.parent[row])
    valid = np.asarray(tr.valid[row])
    n = par.shape[0]
    assert valid[:size].all() and not valid[size:].any()
    assert par[0] == -1 and (par[size:] == -1).all()
    a = np.zeros((n, n), bool)
    for i in range(size):
        a[i, i] = True
        if i > 0:
            assert 0 <= par[i] < i
            a[i] |= a[par[i]]
    np.testing.assert_array_equal(np.asarray(tr.anc[row]), a)
    np.testing.assert_array_equal(np.asarray(tr.depth[row])[:size], a[:size].sum(1) - 1)


@pytest.mark.parametrize("seed", range(4))
def test_select_subtree_random_is_closed_and_best(seed):
    tr = random_tree(seed)
    for row in range(tr.batch):
        check_consistent(tr, row)
    sel = select_subtree
    for bs in (1, 4, 9, 40):
        idx, count = sel(tr, bs)
        for row in range(tr.batch):
            size = int(tr.size[row])
            c = int(count[row])
            assert c == min(bs, size - 1)
            chosen = np.asarray(idx[row, :c])
            assert (np.asarray(idx[row, c:]) == -1).all()
            assert (np.diff(chosen) > 0).all() and (chosen >= 1).all()
            par = np.asarray(tr.parent[row])
            s = set(chosen.tolist())
            assert all(par[i] == 0 or par[i] in s for i in chosen)
            score = np.asarray(tr.score[row])
            rest = [i for i in range(1, size) if i not in s]
            if rest and c:
                assert score[chosen].min() >= score[rest].max()


@pytest.mark.parametrize("seed", range(4))
def test_reroot_random_keeps_exactly_the_descendants(seed):
    tr = random_tree(seed + 10)
    rng = np.random.RandomState(seed)
    b, n = tr.token.shape
    k = 6
    paths = np.full((b, k), -1, np.int32)
    lens = np.zeros(b, np.int32)
    bonus = np.zeros(b, np.int32)
    want_root = []
    for row in range(b):
        size = int(tr.size[row])
        par = np.asarray(tr.parent[row])
        tok = np.asarray(tr.token[row])
        v = int(rng.randint(0, size))  # last accepted node (0: nothing accepted)
        chain = []
        u = v
        while u != 0:
            chain.append(u)
            u = par[u]
        chain = chain[::-1]
        paths[row, : len(chain)] = chain
        lens[row] = len(chain)
        kids = [i for i in range(1, size) if par[i] == v]
        if kids and rng.rand() < 0.75:
            bonus[row] = tok[kids[rng.randint(len(kids))]]
            want_root.append(min(i for i in kids if tok[i] == bonus[row]))
        else:
            bonus[row] = 1000 + row  # not a token of the tree
            want_root.append(-1)
    new, keep_src, n_kept = reroot(tr, jnp.asarray(paths), jnp.asarray(lens), jnp.asarray(bonus))
    for row in range(b):
        check_consistent(new, row)
        c = want_root[row]
        anc = np.asarray(tr.anc[row])
        ks = np.asarray(keep_src[row])
        assert int(new.token[row, 0]) == bonus[row]
        if c < 0:
            assert int(n_kept[row]) == 0 and (ks == -1).all() and int(new.size[row]) == 1
            continue
        desc = [i for i in range(n) if tr.valid[row, i] and anc[i, c]]
        assert int(n_kept[row]) == len(desc) == int(new.size[row])
        np.testing.assert_array_equal(ks[: len(desc)], desc)  # compacted in id order
        assert (ks[len(desc) :] == -1).all()
        old = np.asarray(desc)
        np.testing.assert_array_equal(
            np.asarray(new.token[row, : len(desc)]), np.asarray(tr.token[row])[old]
        )
        np.testing.assert_array_equal(
            np.asarray(new.depth[row, : len(desc)]),
            np.asarray(tr.depth[row])[old] - int(tr.depth[row, c]),
        )
        np.testing.assert_allclose(
            np.asarray(new.score[row, : len(desc)]),
            np.asarray(tr.score[row])[old] - float(tr.score[row, c]),
        )
        remap = {o: i for i, o in enumerate(desc)}
        par = np.asarray(tr.parent[row])
        np.testing.assert_array_equal(
            np.asarray(new.parent[row, : len(desc)]), [-1] + [remap[par[o]] for o in desc[1:]]
        )


# ------------------------------------------------------------------------------------------------
# The slot convention with a real model: draft tree cache, target verify, commit and re-root.

CFG = ModelConfig(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


def _path_tokens(tr, row, node):
    par = np.asarray(tr.parent[row])
    tok = np.asarray(tr.token[row])
    out = []
    while node >= 0:
        out.append(int(tok[node]))
        node = par[node]
    return out[::-1]


def test_tree_forwards_and_reroot_match_full_forward():
    model = new_model(CFG, seed=3)
    net, flat = model.net(), model.flat
    fwd = jax.jit(lambda p, t, c, blk: apply(net, p, t, c, blk))
    checks = []  # (context tokens, logits got): checked at the end in one batched full forward

    def expect(seq, got):
        checks.append(([int(x) for x in seq], np.asarray(got)))

    b, n, p_len = 2, 16, 6
    rng = np.random.RandomState(0)
    prompt = rng.randint(0, CFG.vocab_size, (b, p_len))
    root_slot = jnp.full((b,), p_len - 1, jnp.int32)  # tokens before the root
    root_pos = root_slot

    def prefilled():
        cache = init_cache(CFG, b, 48)
        blk = causal_block(cache.length, cache.length, root_slot, p_len - 1)
        _, cache = fwd(flat, jnp.asarray(prompt[:, :-1]), cache, blk)
        cache.length = root_slot
        return cache

    # --- draft: grow the tree, every expansion's logits equal the full forward of its path
    cache = prefilled()
    tr = new_tree(jnp.asarray(prompt[:, -1]), n)
    expanded = np.zeros((b, n), bool)
    for _ in range(4):
        leaves = best_leaves(tr, 2, expanded)
        tokens, blk = expand_layout(tr, leaves, root_slot, root_pos)
        logits, cache = fwd(flat, tokens, cache, blk)
        for r in range(b):
            for q, leaf in enumerate(np.asarray(leaves[r])):
                if leaf >= 0:
                    expect(list(prompt[r, :-1]) + _path_tokens(tr, r, leaf), logits[r, q])
        ctok, clp = children_of(logits)
        tr, _ = add_children(tr, leaves, ctok, clp)
        expanded = mark(expanded, leaves)

    # --- target: verify the best 6 nodes; every slot equals the full forward of its path
    tcache = prefilled()
    idx, count = select_subtree(tr, 6)
    tb = verify_layout(tr, idx, count, root_slot, root_pos)
    tlogits, tcache = fwd(flat, tb.tokens, tcache, tb.block)
    for r in range(b):
        for t, node in enumerate(np.asarray(tb.node[r])):
            if node >= 0:
                expect(list(prompt[r, :-1]) + _path_tokens(tr, r, node), tlogits[r, t])
    path, n_acc, nxt = greedy_walk(tb, tlogits)
    assert int(n_acc.min()) >= 1  # the draft is the target: its top child is accepted
    src, cnt = verify_commit_src(tcache.length, path, n_acc)
    tcache = commit(tcache, src, cnt)
    np.testing.assert_array_equal(tcache.length, root_slot + 1 + n_acc)
    one = causal_block(tcache.length, tcache.length, jnp.ones((b,), jnp.int32), 1)
    logits, _ = fwd(flat, nxt[:, None], tcache, one)
    nodes = path_nodes(tb, path)
    for r in range(b):
        last = int(nodes[r, int(n_acc[r]) - 1])
        seq = list(prompt[r, :-1]) + _path_tokens(tr, r, last) + [int(nxt[r])]
        expect(seq, logits[r, 0])

    # --- draft re-root. Row 0: accept v1 and re-root on its expanded child c (moved K/V);
    # row 1: accept v1 and emit a token that is not a child (fresh tree).
    par = np.asarray(tr.parent)
    dep = np.asarray(tr.depth)
    exp_np = np.asarray(expanded)
    c0 = next(
        i
        for i in np.argsort(-np.asarray(tr.score[0]), kind="stable")
        if dep[0, i] == 2 and exp_np[0, i]
    )
    v0 = par[0, c0]
    v1 = 1
    kids1 = set(np.asarray(tr.token[1])[par[1] == v1].tolist())
    bonus1 = next(x for x in range(CFG.vocab_size) if x not in kids1)
    paths = jnp.array([[v0], [v1]], jnp.int32)
    lens = jnp.array([1, 1], jnp.int32)
    bonus = jnp.array([int(tr.token[0, c0]), bonus1], jnp.int32)
    new, keep_src, n_kept = reroot(tr, paths, lens, bonus)
    assert int(n_kept[0]) >= 2 and int(n_kept[1]) == 0
    src, cnt, new_root_slot = reroot_kv_src(root_slot, paths, lens, keep_src)
    dst, length = reroot_kv_dst(root_slot, root_pos, lens, cnt, src.shape[1], None)
    np.testing.assert_array_equal(length, new_root_slot)
    cache = move(cache, src, dst, length)  # the draft's re-root (tree_drafts.ModelTreeDraft)
    ks = np.asarray(keep_src)
    new_exp = np.take_along_axis(expanded, np.maximum(ks, 0), axis=1) & (ks >= 0)
    assert bool(new_exp[0, 0]) and not bool(new_exp[1, 0])
    # context of the new root: prompt, old root, v
    before = [list(prompt[r, :]) + _path_tokens(tr, r, int(paths[r, 0]))[1:] for r in range(b)]
    for _ in range(2):
        leaves = best_leaves(new, 2, new_exp)
        tokens, blk = expand_layout(new, leaves, new_root_slot, new_root_slot)
        logits, cache = fwd(flat, tokens, cache, blk)
        for r in range(b):
            for q, leaf in enumerate(np.asarray(leaves[r])):
                if leaf >= 0:
                    expect(before[r] + _path_tokens(new, r, leaf), logits[r, q])
        ctok, clp = children_of(logits)
        new, _ = add_children(new, leaves, ctok, clp)
        new_exp = mark(new_exp, leaves)

    # the oracle: one full causal forward over all contexts (padded), logits at each last token
    lens = np.array([len(s) for s, _ in checks])
    toks = np.zeros((len(checks), lens.max()), np.int32)
    for i, (s, _) in enumerate(checks):
        toks[i, : len(s)] = s
    fc = init_cache(CFG, len(checks), toks.shape[1])
    zeros = jnp.zeros((len(checks),), jnp.int32)
    blk = causal_block(zeros, zeros, jnp.asarray(lens, jnp.int32), toks.shape[1])
    ref, _ = fwd(flat, jnp.asarray(toks), fc, blk)
    ref = np.asarray(ref)[np.arange(len(checks)), lens - 1]
    np.testing.assert_allclose(np.stack([g for _, g in checks]), ref, atol=1e-5)
    assert len(checks) > 30


# ------------------------------------------------------------------------------------------------
# The loop-free forms (add_children's one-hot update, add_path, the greedy walk) against plain
# numpy references of their definitions, on random inputs with duplicates, drops and overflow.


def add_children_reference(tr, parents, tokens, lp):
    """``add_children`` by its docstring, one child at a time."""
    out = {f: np.array(getattr(tr, f)) for f in ("token", "parent", "depth", "score", "valid")}
    anc, size = np.array(tr.anc), np.array(tr.size)
    size0, valid0 = size.copy(), out["valid"].copy()  # parents are nodes from before the call
    b, w, k = tokens.shape
    n = out["token"].shape[1]
    new = np.full((b, w, k), -1)
    for r in range(b):
        for i in range(w):
            for j in range(k):
                p, v = parents[r, i], lp[r, i, j]
                if p < 0 or p >= size0[r] or not valid0[r, p] or not v > -np.inf:
                    continue
                if size[r] >= n:
                    continue
                c = size[r]
                size[r] += 1
                new[r, i, j] = c
                out["token"][r, c], out["parent"][r, c] = tokens[r, i, j], p
                out["depth"][r, c] = out["depth"][r, p] + 1
                out["score"][r, c] = out["score"][r, p] + np.float32(v)
                out["valid"][r, c] = True
                anc[r, c] = anc[r, p]
                anc[r, c, c] = True
    return out, anc, size, new


@pytest.mark.parametrize("seed", range(6))
def test_add_children_equals_the_one_at_a_time_definition(seed):
    rng = np.random.RandomState(seed)
    tr = random_tree(seed, n=20, rounds=rng.randint(0, 4))
    b, n = tr.token.shape
    w, k = 4, 3
    parents = rng.randint(-2, n, (b, w))  # -1 / -2: skipped; >= size: not a node
    tokens = rng.randint(0, 5, (b, w, k))
    lp = -rng.choice([0.0, 0.5, np.inf, np.nan, 2.0], (b, w, k)).astype(np.float32)
    got, ids = add_children(tr, jnp.asarray(parents), jnp.asarray(tokens), jnp.asarray(lp))
    want, anc, size, new = add_children_reference(tr, parents, tokens, lp)
    for f, v in want.items():
        np.testing.assert_array_equal(np.asarray(getattr(got, f)), v, err_msg=f)
    np.testing.assert_array_equal(np.asarray(got.anc), anc)
    np.testing.assert_array_equal(np.asarray(got.size), size)
    np.testing.assert_array_equal(np.asarray(ids), new)


@pytest.mark.parametrize("seed", range(6))
def test_add_path_equals_one_child_at_a_time(seed):
    rng = np.random.RandomState(seed)
    tr = random_tree(seed, n=16, rounds=rng.randint(0, 3))
    b, n = tr.token.shape
    d = 9  # some rows overflow the capacity
    parent = rng.randint(-1, 12, b)
    tokens = rng.randint(0, 50, (b, d))
    lp = -rng.choice([0.0, 0.25, 1.0, np.inf], (b, d), p=[0.4, 0.3, 0.2, 0.1]).astype(np.float32)
    got = jax.jit(T.add_path)(tr, jnp.asarray(parent), jnp.asarray(tokens), jnp.asarray(lp))
    want, par = tr, jnp.asarray(parent)[:, None]
    for i in range(d):
        want, new = add_children(want, par, jnp.asarray(tokens[:, i, None, None]),
                                 jnp.asarray(lp[:, i, None, None]))  # fmt: skip
        par = new[:, :, 0]
    for f in ("token", "parent", "depth", "score", "valid", "size", "anc"):
        np.testing.assert_array_equal(np.asarray(getattr(got, f)), np.asarray(getattr(want, f)), f)
    for r in range(b):
        check_consistent(got, r)


def walk_reference(tokens, parent, valid, target):
    """The greedy walk, step by step: descend into the lowest valid child whose token is the
    target's argmax after the current slot."""
    b, t = tokens.shape
    path, ns, nxt = np.full((b, t - 1), -1), np.zeros(b, int), np.zeros(b, int)
    for r in range(b):
        cur, n = 0, 0
        while True:
            hits = [j for j in range(1, t) if valid[r, j] and parent[r, j] == cur
                    and tokens[r, j] == target[r, cur]]  # fmt: skip
            if not hits:
                break
            cur = hits[0]
            path[r, n] = cur
            n += 1
        ns[r], nxt[r] = n, target[r, cur]
    return path, ns, nxt


@pytest.mark.parametrize("seed", range(8))
def test_greedy_walk_equals_the_step_by_step_walk(seed):
    """Random blocks (parents before children, duplicate sibling tokens, padding slots, a
    3-token vocabulary so that paths run deep) against the walk's definition."""
    rng = np.random.RandomState(seed)
    b, t = 16, int(rng.choice([2, 5, 9, 17]))
    parent = np.full((b, t), -1)
    for j in range(1, t):  # often the slot before: long chains
        parent[:, j] = np.where(rng.rand(b) < 0.5, j - 1, rng.randint(0, j, b))
    valid = rng.rand(b, t) < 0.85
    valid[:, 0] = True
    parent = np.where(valid, parent, -1)
    tokens = rng.randint(0, 3, (b, t))
    target = rng.randint(0, 3, (b, t))
    for r in range(b):  # mostly the token of one of the slot's children: paths run deep
        for c in range(t):
            kids = np.flatnonzero(parent[r] == c)
            if len(kids) and rng.rand() < 0.8:
                target[r, c] = tokens[r, rng.choice(kids)]
    got = ACCEPT_TREE_GREEDY(*(jnp.asarray(x) for x in (tokens, parent, valid, target)))
    want = walk_reference(tokens, parent, valid, target)
    for g, w, name in zip(got, want, ("path", "n", "next"), strict=True):
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)
    assert np.asarray(got[1]).max() >= min(t - 1, 3), "shallow paths: the jumps go unseen"


ACCEPT_TREE_GREEDY = jax.jit(accept_tree_greedy)


@pytest.mark.parametrize("v", [2049, 3000, 4096, 49152])
def test_chunked_top_k_equals_lax_top_k(v):
    """``tensor_parallel.top_k`` (a tree draft's children, in two stages) gives ``lax.top_k``'s
    values and indices: coarse values (many ties, lowest index first), -inf entries, a row with
    fewer finite entries than k, widths that do and do not fill the last chunk."""
    from jaxspec.model import tensor_parallel

    rng = np.random.RandomState(v)
    x = rng.choice([0.0, -0.5, -1.0, -2.0, -np.inf], (5, v), p=[0.02, 0.1, 0.3, 0.5, 0.08])
    x[1] = -np.inf
    x[1, [7, v - 1]] = [-3.0, -1.0]
    x[2] = rng.standard_normal(v)
    x = jnp.asarray(x, jnp.float32)
    for k in (1, 4, 8):
        got = jax.jit(tensor_parallel.top_k, static_argnums=1)(x, k)
        want = jax.lax.top_k(x, k)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
