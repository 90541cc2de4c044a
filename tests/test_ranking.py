"""Counted ranks (``jaxspec.ranking``) give what the sorts they replace give, ties included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import ranking
from jaxspec.spec import tree as T
from tests.test_tree import mark, random_tree


def coarse(rng, shape):
    """Values with many ties, zeros and -inf: where an order's tie-breaking shows."""
    return rng.choice([0.0, -0.5, -1.0, -2.0, -np.inf], shape, p=[0.1, 0.2, 0.3, 0.3, 0.1])


@pytest.mark.parametrize("n", [1, 7, 129, 192])
def test_top_k_equals_lax_top_k(n):
    rng = np.random.RandomState(n)
    x = coarse(rng, (3, 2, n))
    x[0, 0] = -np.inf  # a row of nothing but ties
    x[1] = rng.standard_normal((2, n))
    x = jnp.asarray(x, jnp.float32)
    for k in sorted({1, min(4, n), min(8, n), n}):
        got = jax.jit(ranking.top_k, static_argnums=1)(x, k)
        for g, w in zip(got, jax.lax.top_k(x, k), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_ranks_equal_a_stable_lexicographic_sort():
    """Two keys (a float with ties and infinities, an int with ties), the index last: every
    entry's rank is its place in ``lax.sort``'s order; ``compact`` equals numpy's."""
    rng = np.random.RandomState(0)
    k1 = jnp.asarray(np.where(rng.rand(4, 60) < 0.1, np.inf, -coarse(rng, (4, 60))), jnp.float32)
    k2 = jnp.asarray(rng.randint(0, 3, (4, 60)), jnp.int32)
    ids = jnp.broadcast_to(jnp.arange(60), (4, 60))
    _, _, order = jax.lax.sort((k1, k2, ids), dimension=1, num_keys=3)
    rank = np.asarray(ranking.ranks(k1, k2))
    want = np.empty_like(rank)
    np.put_along_axis(want, np.asarray(order), np.arange(60)[None, :], axis=1)
    np.testing.assert_array_equal(rank, want)
    keep = rng.rand(4, 60) < 0.3
    got = np.asarray(ranking.compact(jnp.asarray(keep), 12))
    for row in range(4):
        on = np.flatnonzero(keep[row])[:12]
        np.testing.assert_array_equal(got[row], np.pad(on, (0, 12 - len(on)), constant_values=-1))


@pytest.mark.parametrize("seed", range(3))
def test_tree_selection_counted_equals_sorted(seed, monkeypatch):
    """``best_leaves`` and ``select_subtree`` count ranks for short rows; with the bound at 0
    they sort as before: the same nodes, on random trees with tied scores."""
    trees = [random_tree(seed + 10 * i, n=n) for i, n in enumerate((24, 40))]
    none = [jnp.zeros(t.token.shape, bool) for t in trees]
    expanded = [
        jnp.asarray(mark(e, T.best_leaves(t, 3, e))) for t, e in zip(trees, none, strict=True)
    ]

    def picks():
        out = []
        for t, e in zip(trees, expanded, strict=True):
            for w in (1, 3, 8):
                out.append(np.asarray(T.best_leaves(t, w, e)))
            for bs in (1, 5, 16, 60):
                out += [np.asarray(x) for x in T.select_subtree(t, bs)]
        return out

    counted = picks()
    monkeypatch.setattr(ranking, "MAX_COUNTED", 0)
    for got, want in zip(counted, picks(), strict=True):
        np.testing.assert_array_equal(got, want)
