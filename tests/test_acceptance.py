"""Losslessness of the acceptance rules.

* Exact enumeration (float64): summing over every draft outcome with its q probability and the
  rule's acceptance probabilities gives the target's p exactly.
* Fixed-seed chi-square tests of the jitted rules on a tiny vocabulary: the first emitted token,
  and the first two jointly, follow the target (a Markov toy: p(next | last token)); negative
  controls (a broken rule: residual skipped, always accept, a tree walked by the draft's draws)
  must fail the same test.
* Greedy: exact argmax matches, no randomness, edge cases.
"""

import functools
import itertools
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.spec import acceptance as A
from jaxspec.spec import tree as T

V = 5
ACCEPT_TREE = jax.jit(A.accept_tree)
ACCEPT_TREE_GREEDY = jax.jit(A.accept_tree_greedy)
SAMPLES = 100_000
ALPHA = 1e-4


def chi2_critical(df, alpha=ALPHA):
    """Upper critical value of chi-square(df) (Wilson-Hilferty; scipy is not a dependency)."""
    z = statistics.NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def chi2(counts, probs):
    """(statistic, critical value) of observed counts against expected probabilities."""
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    expected = counts.sum() * probs
    if np.any((expected == 0) & (counts > 0)):
        return np.inf, chi2_critical(max(int((probs > 0).sum()) - 1, 1))
    live = expected > 0
    stat = np.sum((counts[live] - expected[live]) ** 2 / expected[live])
    return stat, chi2_critical(int(live.sum()) - 1)


def test_chi2_critical_is_right():
    # chi-square quantiles at 1 - 1e-4 (df 4: 23.513, df 24: 58.613); the approximation errs
    # on the high side at small df, by a few percent
    assert 23.513 <= chi2_critical(4) < 23.513 * 1.03
    assert 58.613 <= chi2_critical(24) < 58.613 * 1.01


def markov_toy(seed, *, scale=2.0, greedy_draft=False):
    """p(next | last) and q(next | last) tables [V, V] and a root token. The target's logits are
    scale * normal; the draft's are the target's plus as much noise (a draft that agrees with the
    target in part); a greedy draft is one-hot at the argmax of its logits."""
    rng = np.random.RandomState(seed)
    lp = scale * rng.randn(V, V)
    lq = lp + scale * rng.randn(V, V)

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    tq = np.eye(V)[lq.argmax(-1)] if greedy_draft else softmax(lq)
    return softmax(lp).astype(np.float32), tq.astype(np.float32), int(rng.randint(V))


def first_two(tokens_emitted, n_emitted, tp, key):
    """The first two emitted tokens; when a step emitted one, the second is drawn from the target
    (what a correct next step emits, as the first-token test shows)."""
    e0 = tokens_emitted[:, 0]
    cont = jax.random.categorical(key, jnp.log(tp)[e0])
    return e0, jnp.where(n_emitted >= 2, tokens_emitted[:, 1], cont)


def joint_counts(e0, e1):
    return np.bincount(np.asarray(e0) * V + np.asarray(e1), minlength=V * V).reshape(V, V)


def expected_joint(tp, root):
    return tp[root][:, None] * tp


# ------------------------------------------------------------------------------------------------
# Helpers and exact enumeration (float64)


def test_residual():
    rng = np.random.RandomState(0)
    p = rng.dirichlet(np.ones(V), 8).astype(np.float32)
    q = rng.dirichlet(np.ones(V), 8).astype(np.float32)
    r = np.maximum(p - q, 0)
    pj, qj = jnp.asarray(p), jnp.asarray(q)
    np.testing.assert_allclose(A.residual(pj, qj), r / r.sum(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_array_equal(A.residual(pj, pj), p)  # all-zero residual: p itself


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("greedy_draft", [False, True])
def test_chain_rule_exact_enumeration(seed, greedy_draft):
    """G = 2 drafts on the Markov toy: the first two emitted tokens are exactly p(x) p(y | x)."""
    tp, tq, root = markov_toy(seed, greedy_draft=greedy_draft)
    with jax.enable_x64(True):
        tp, tq = tp.astype(np.float64), tq.astype(np.float64)
        tp, tq = tp / tp.sum(-1, keepdims=True), tq / tq.sum(-1, keepdims=True)

        def res(p, q):
            return np.asarray(A.residual(jnp.asarray(p), jnp.asarray(q)))

        out = np.zeros((V, V))
        for d0, d1 in itertools.product(range(V), repeat=2):
            w = tq[root, d0] * tq[d0, d1]
            if w == 0:
                continue
            a0 = min(1.0, tp[root, d0] / tq[root, d0])
            a1 = min(1.0, tp[d0, d1] / tq[d0, d1])
            r0 = res(tp[root], tq[root])
            out += w * (1 - a0) * r0[:, None] * tp  # reject d0: x ~ r0, then y ~ p(. | x)
            out[d0] += w * a0 * (1 - a1) * res(tp[d0], tq[d0])  # accept d0, reject d1
            out[d0, d1] += w * a0 * a1  # accept both
        np.testing.assert_allclose(out, expected_joint(tp, root), atol=1e-12)


# ------------------------------------------------------------------------------------------------
# Chain: chi-square of the jitted rule


# The samplers are jitted once per shape; the toy tables and the root are arguments, never
# closed-over constants (XLA would constant-fold the whole computation at compile time). A rule
# is a static argument: a fresh lambda forces a new trace (for the monkeypatched controls).


@functools.partial(jax.jit, static_argnames=("b", "g"))
def chain_drafts(key, tpj, tqj, root, *, b, g):
    """Each of b rows drafts g tokens from q after ``root``; returns (drafts, q rows, p rows)."""
    last = jnp.full((b,), root, jnp.int32)
    drafts, qs, ps = [], [], [tpj[last]]
    for kk in jax.random.split(key, g):
        qs.append(tqj[last])
        last = jax.random.categorical(kk, jnp.log(tqj[last])).astype(jnp.int32)
        drafts.append(last)
        ps.append(tpj[last])
    return jnp.stack(drafts, 1), jnp.stack(qs, 1), jnp.stack(ps, 1)


@functools.partial(jax.jit, static_argnames=("rule",))
def chain_emit(key, d, q, p, tpj, *, rule):
    k_acc, k_cont = jax.random.split(key)
    g = d.shape[1]
    n, nxt = rule(k_acc, d, q, p)
    emitted = jnp.concatenate([d, nxt[:, None]], 1)
    emitted = jnp.where(jnp.arange(g + 1) == n[:, None], nxt[:, None], emitted)
    return first_two(emitted, n + 1, tpj, k_cont)


def run_chain(seed, toy, rules, g=3):
    """For each rule: (first-token counts, first-two counts) over SAMPLES chains."""
    tp, tq, root = toy
    k_draft, k_acc = jax.random.split(jax.random.PRNGKey(seed))
    tpj, tqj = jnp.asarray(tp), jnp.asarray(tq)
    d, q, p = chain_drafts(k_draft, tpj, tqj, jnp.int32(root), b=SAMPLES, g=g)
    out = []
    for rule in rules:
        e0, e1 = chain_emit(k_acc, d, q, p, tpj, rule=rule)
        out.append((np.bincount(np.asarray(e0), minlength=V), joint_counts(e0, e1)))
    return out


def broken_always_accept(key, d, q, p):
    b, g = d.shape
    return jnp.full((b,), g, jnp.int32), A.draw(key, p[:, g])


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("greedy_draft", [False, True])
def test_chain_distribution(seed, greedy_draft, monkeypatch):
    toy = markov_toy(seed + 100, greedy_draft=greedy_draft)
    tp, _, root = toy
    want0, want01 = tp[root], expected_joint(tp, root)
    (c0, c01), (b0, _) = run_chain(seed, toy, [A.accept_chain, broken_always_accept])
    for counts, probs in ((c0, want0), (c01, want01)):
        stat, crit = chi2(counts, probs)
        assert stat < crit, (stat, crit)
    # negative controls: always accept; skip the residual (redraw from p on rejection)
    stat, crit = chi2(b0, want0)
    assert stat > crit, (stat, crit)
    monkeypatch.setattr(A, "residual", lambda p, q: p)
    [(_, b01)] = run_chain(seed, toy, [lambda *a: A.accept_chain(*a)])
    stat, crit = chi2(b01, want01)
    assert stat > crit, (stat, crit)


# ------------------------------------------------------------------------------------------------
# Trees: chi-square of the jitted rules on a fixed shape (root: 3 children, each: 2 children)

SHAPE = (3, 2)


def draws_of(key, q, k, *, replacement):
    """k children drawn from q in draw order: without replacement (Gumbel-top-k) or i.i.d.;
    their log q as the tree score increments (-inf past q's support, dropped by add_children)."""
    logq = jnp.log(q)
    if replacement:
        tok = jax.random.categorical(key, logq[..., None, :], axis=-1, shape=q.shape[:-1] + (k,))
    else:
        _, tok = jax.lax.top_k(logq + jax.random.gumbel(key, q.shape), k)
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logq, tok, axis=-1)


@functools.partial(jax.jit, static_argnames=("b", "how"))
def build_block(key, tqj, root, *, b, how):
    """A full tree of SHAPE per row, children by ``how``: 'top' (deterministic top-k of q),
    'sample' (draws from q without replacement), 'iid' (with replacement); its verify block
    (all nodes, via select_subtree and verify_layout)."""
    tr = T.new_tree(jnp.full((b,), root, jnp.int32), 1 + SHAPE[0] + SHAPE[0] * SHAPE[1])
    parents = jnp.zeros((b, 1), jnp.int32)
    for depth, k in enumerate(SHAPE):
        qd = tqj[jnp.take_along_axis(tr.token, jnp.maximum(parents, 0), axis=1)]  # [b, w, V]
        if how == "top":
            tok, lq = A.top_children(jnp.log(qd), k)
        else:
            kk = jax.random.fold_in(key, depth)
            tok, lq = draws_of(kk, qd, k, replacement=how == "iid")
        tr, ids = T.add_children(tr, parents, tok, lq)
        parents = ids.reshape(b, -1)
    idx, count = T.select_subtree(tr, tr.capacity - 1)
    return T.verify_layout(tr, idx, count, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("rule",))
def tree_emit(key, tb, tpj, tqj, *, rule):
    k_acc, k_cont = jax.random.split(key)
    p = tpj[tb.tokens]  # the target's distribution after each node (Markov toy)
    q = tqj[tb.tokens]
    path, n, nxt = rule(k_acc, tb.tokens, tb.parent, tb.valid, p, q)
    m = path.shape[1]
    emitted = jnp.take_along_axis(tb.tokens, jnp.maximum(path, 0), axis=1)
    emitted = jnp.concatenate([emitted, nxt[:, None]], 1)
    emitted = jnp.where(jnp.arange(m + 1) == n[:, None], nxt[:, None], emitted)
    return first_two(emitted, n + 1, tpj, k_cont), n


def run_tree(seed, toy, how, rules):
    """For each rule: (first-token counts, first-two counts, accepted lengths)."""
    tp, tq, root = toy
    k_tree, k_acc = jax.random.split(jax.random.PRNGKey(seed))
    tpj, tqj = jnp.asarray(tp), jnp.asarray(tq)
    tb = build_block(k_tree, tqj, jnp.int32(root), b=SAMPLES, how=how)
    out = []
    for rule in rules:
        (e0, e1), n = tree_emit(k_acc, tb, tpj, tqj, rule=rule)
        out.append((np.bincount(np.asarray(e0), minlength=V), joint_counts(e0, e1), np.asarray(n)))
    return out


def target_rule(key, tokens, parent, valid, p, q):
    return A.accept_tree(key, tokens, parent, valid, p)


def broken_draft_walk(key, tokens, parent, valid, p, q):
    """accept_tree walked by the draft's draws instead of the target's: not lossless."""
    return A.accept_tree(key, tokens, parent, valid, q)


@pytest.mark.parametrize("how", ["top", "sample", "iid"])
def test_accept_tree_distribution_any_children(how):
    """accept_tree is lossless whatever the children: deterministic top-k or sampled (with or
    without replacement); the same walk on the draft's draws fails the same test."""
    toy = markov_toy(7, scale=1.0)
    tp, _, root = toy
    [(c0, c01, n), (b0, b01, _)] = run_tree(1, toy, how, [target_rule, broken_draft_walk])
    assert 0.2 < (n >= 1).mean() < 0.99 and (n == 2).mean() > 0.05
    for counts, probs in ((c0, tp[root]), (c01, expected_joint(tp, root))):
        stat, crit = chi2(counts, probs)
        assert stat < crit, (stat, crit)
    for counts, probs in ((b0, tp[root]), (b01, expected_joint(tp, root))):
        stat, crit = chi2(counts, probs)
        assert stat > crit, (stat, crit)


# ------------------------------------------------------------------------------------------------
# Greedy


def test_accept_chain_greedy_prefixes():
    rng = np.random.RandomState(0)
    b, g = 7, 5
    d = rng.randint(0, 50, (b, g))
    t = rng.randint(0, 50, (b, g + 1))
    m = np.array([0, 1, 2, 3, 4, 5, 5])
    for r in range(b):
        t[r, : m[r]] = d[r, : m[r]]
        if m[r] < g:
            t[r, m[r]] = (d[r, m[r]] + 1) % 50
    d, t = jnp.asarray(d), jnp.asarray(t)
    n, nxt = jax.jit(A.accept_chain_greedy)(d, t)
    np.testing.assert_array_equal(n, m)
    np.testing.assert_array_equal(nxt, np.asarray(t)[np.arange(b), m])
    # n_draft limits the accepted drafts; the next token is the target's at the limit
    n, nxt = A.accept_chain_greedy(d, t, jnp.array([0, 0, 1, 5, 2, 4, 5]))
    np.testing.assert_array_equal(n, [0, 0, 1, 3, 2, 4, 5])
    np.testing.assert_array_equal(nxt, np.asarray(t)[np.arange(b), [0, 0, 1, 3, 2, 4, 5]])


@pytest.mark.parametrize("seed", range(3))
def test_accept_chain_one_hot_p_is_greedy(seed):
    rng = np.random.RandomState(seed)
    b, g, v = 64, 4, 6
    t = rng.randint(0, v, (b, g + 1))
    d = np.where(rng.rand(b, g) < 0.7, t[:, :g], rng.randint(0, v, (b, g)))
    q = rng.dirichlet(np.ones(v), (b, g)).astype(np.float32)
    q[:, :, :] = np.where(rng.rand(b, g, 1) < 0.3, np.eye(v)[d], q)  # some greedy drafts too
    p = np.eye(v, dtype=np.float32)[t]
    d, t, q, p = map(jnp.asarray, (d, t, q, p))
    want = A.accept_chain_greedy(d, t)
    f = jax.jit(A.accept_chain)
    nd = jnp.asarray(rng.randint(0, g + 1, b))
    want_nd = A.accept_chain_greedy(d, t, nd)
    for k in range(4):
        got = f(jax.random.PRNGKey(k), d, q, p)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        got = f(jax.random.PRNGKey(k), d, q, p, nd)
        np.testing.assert_array_equal(got[0], want_nd[0])
        np.testing.assert_array_equal(got[1], want_nd[1])


def test_accept_chain_edge_cases():
    v = 4
    d = jnp.array([[1, 2, 3]])
    q = jnp.full((1, 3, v), 1 / v, jnp.float32)
    p = jnp.eye(v, dtype=jnp.float32)[
        jnp.array([[1, 2, 3, 0]])
    ]  # all drafts are the target's argmax
    n, nxt = A.accept_chain(jax.random.PRNGKey(0), d, q, p)
    assert int(n[0]) == 3 and int(nxt[0]) == 0  # full acceptance: bonus from p[G]
    p = jnp.eye(v, dtype=jnp.float32)[jnp.array([[2, 2, 3, 0]])]
    n, nxt = A.accept_chain(jax.random.PRNGKey(0), d, q, p)
    assert int(n[0]) == 0 and int(nxt[0]) == 2  # zero acceptance: the correction is the argmax
    # p == q: every draft accepted whatever the key
    pq = jnp.asarray(np.random.RandomState(0).dirichlet(np.ones(v), (1, 4)), jnp.float32)
    for k in range(5):
        n, _ = A.accept_chain(jax.random.PRNGKey(k), d, pq[:, :3], pq)
        assert int(n[0]) == 3


def hand_block():
    """The verify block of test_tree's hand tree, all 9 nodes: slot -> node
    0:0 1:1 2:2 3:3 4:4 5:5 6:6 7:7 8:8 9:9 (tokens 100, 10, 11, 12, 20, 21, 30, 40, 41, 50)."""
    tokens = np.array([[100, 10, 11, 12, 20, 21, 30, 40, 41, 50]])
    parent = np.array([[-1, 0, 0, 0, 1, 1, 3, 4, 4, 2]])
    return jnp.asarray(tokens), jnp.asarray(parent), jnp.ones(tokens.shape, bool)


def test_accept_tree_greedy_hand():
    tokens, parent, valid = hand_block()
    f = jax.jit(A.accept_tree_greedy)
    t = np.full((1, 10), 99)
    t[0, 0], t[0, 1], t[0, 4], t[0, 7] = 10, 20, 40, 55  # root -> 1 -> 4 -> 7 (leaf), bonus 55
    path, n, nxt = f(tokens, parent, valid, jnp.asarray(t))
    np.testing.assert_array_equal(path, [[1, 4, 7] + [-1] * 6])
    assert int(n[0]) == 3 and int(nxt[0]) == 55
    t[0, 4] = 41  # root -> 1 -> 4 -> 8: a full path to another leaf, bonus = target at 8 (99)
    path, n, nxt = f(tokens, parent, valid, jnp.asarray(t))
    np.testing.assert_array_equal(path[0, :3], [1, 4, 8])
    assert int(n[0]) == 3 and int(nxt[0]) == 99
    t[0, 1] = 77  # root -> 1, then no child of 1 has 77
    path, n, nxt = f(tokens, parent, valid, jnp.asarray(t))
    np.testing.assert_array_equal(path, [[1] + [-1] * 8])
    assert int(n[0]) == 1 and int(nxt[0]) == 77
    t[0, 0] = 5  # zero acceptance
    path, n, nxt = f(tokens, parent, valid, jnp.asarray(t))
    np.testing.assert_array_equal(path, -np.ones((1, 9)))
    assert int(n[0]) == 0 and int(nxt[0]) == 5
    t[0, 0], t[0, 2] = 11, 50  # root -> 2 -> 9, but slot 9 is padding: stop at 2
    path, n, nxt = f(tokens, parent, valid & (jnp.arange(10) != 9), jnp.asarray(t))
    np.testing.assert_array_equal(path[0, :2], [2, -1])
    assert int(n[0]) == 1 and int(nxt[0]) == 50


@pytest.mark.parametrize("seed", range(3))
def test_accept_tree_with_one_hot_p_is_greedy(seed):
    """Batched random trees: with a one-hot target accept_tree walks exactly the argmax matches
    (accept_tree_greedy's), whatever the key."""
    rng = np.random.RandomState(seed)
    b, n, v = 32, 12, 4
    parent = np.full((b, n), -1)
    for i in range(1, n):
        parent[:, i] = rng.randint(0, i, b)
    tokens = rng.randint(0, v, (b, n))
    valid = rng.rand(b, n) < 0.9
    valid[:, 0] = True
    target = rng.randint(0, v, (b, n))
    for i in range(1, n):  # make matches likely
        tokens[:, i] = np.where(rng.rand(b) < 0.6, target[np.arange(b), parent[:, i]], tokens[:, i])
    p = np.eye(v, dtype=np.float32)[target]
    tokens, parent, valid, target, p = map(jnp.asarray, (tokens, parent, valid, target, p))
    want = ACCEPT_TREE_GREEDY(tokens, parent, valid, target)
    assert int(np.asarray(want[1]).max()) >= 2
    for k in range(3):
        key = jax.random.PRNGKey(k)
        got = ACCEPT_TREE(key, tokens, parent, valid, p)
        for x, y in zip(got, want, strict=True):
            np.testing.assert_array_equal(x, y)
