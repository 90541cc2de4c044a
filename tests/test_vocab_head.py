"""A draft's LM head over a subset of the vocabulary (``model.vocab_head``, FR-Spec): the
subset's logits are the whole head's, the rest -inf; every engine stays greedy-equal to
autoregressive decoding (float32) on random subsets, ragged prompts and seeds, including a
subset of one token, one without any token the target emits (zero acceptance) and the whole
vocabulary with the target as its own draft (full acceptance)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.api import generate
from jaxspec.errors import OptionError
from jaxspec.model import tensor_parallel, vocab_head
from jaxspec.model.feature_head import random_head
from jaxspec.model.transformer import apply, whole_block
from jaxspec.model.vocab_head import frequent_ids, vocab_size_of, with_vocab
from tests import tiny

V = tiny.CFG.vocab_size
NEW = 16


def test_frequent_ids_rank_by_count_lowest_id_first_with_the_forced_ids():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, V)  # many ties
    got = frequent_ids(counts, 20)
    assert got.dtype == np.int32 and np.all(np.diff(got) > 0)
    order = sorted(range(V), key=lambda t: (-counts[t], t))
    assert got.tolist() == sorted(order[:20])
    rare = order[-1]
    forced = frequent_ids(counts, 20, always=(rare,))
    assert rare in forced and forced.size == 20
    assert sorted(set(forced) - {rare}) == sorted(order[:19])
    assert frequent_ids(counts, 20, always=(order[0],)).tolist() == got.tolist()
    for bad in (0, V + 1):
        with pytest.raises(OptionError, match="draft vocabulary"):
            frequent_ids(counts, bad)
    draft = tiny.model(0)
    for ids in ([], [-1, 3], [2, V]):
        with pytest.raises(OptionError, match="distinct token ids"):
            with_vocab(draft, np.array(ids, np.int64))
    assert vocab_size_of(with_vocab(draft, np.array([5, 3, 5]))) == 2  # each id once


@pytest.mark.parametrize("tied", [True, False])
def test_the_subsets_logits_are_the_whole_heads_and_the_rest_minus_infinity(tied):
    draft = tiny.model(5, tie_word_embeddings=tied)
    ids = np.sort(np.random.default_rng(1).choice(V, 23, replace=False))
    small = with_vocab(draft, ids)
    assert vocab_size_of(small) == 23 and vocab_size_of(draft) is None
    x = tiny.prompts(2)[0]
    full, cut = np.asarray(draft.logits([x])), np.asarray(small.logits([x]))
    np.testing.assert_allclose(cut[..., ids], full[..., ids], rtol=1e-5, atol=1e-6)
    rest = np.setdiff1d(np.arange(V), ids)
    assert np.all(np.isneginf(cut[..., rest]))
    back = with_vocab(small, None)  # the whole head again, the same arrays
    assert vocab_size_of(back) is None
    np.testing.assert_array_equal(np.asarray(back.logits([x])), full)
    assert any(a is b for a in jax.tree.leaves(small.params) for b in jax.tree.leaves(draft.params))


@pytest.mark.parametrize("size,k", [(23, 4), (3, 5)])  # k past the subset: the whole row
def test_the_subsets_own_logits_give_the_whole_rows_children_and_argmax(size, k):
    """``apply(..., subset=True)`` (the draft steps' logits: no scatter into the vocabulary)
    read through ``vocab_head.top_log_probs`` / ``argmax`` give what the whole-vocabulary
    logits give through ``tensor_parallel``'s."""
    draft = tiny.model(6)
    ids = np.sort(np.random.default_rng(size).choice(V, size, replace=False))
    small = with_vocab(draft, ids)
    net, tokens = small.net(), jnp.asarray(tiny.prompts(1, lengths=(9,))[0])[None]

    @jax.jit
    def both(flat):
        cache, block = whole_block(net.cfg, 1, tokens.shape[1], net.dtype)
        cut, _ = apply(net, flat, tokens, cache, block, subset=True)
        full, _ = apply(net, flat, tokens, cache, block)
        ours = vocab_head.top_log_probs(net, flat, cut, k), vocab_head.argmax(net, flat, cut)
        theirs = tensor_parallel.top_log_probs(net, full, k), tensor_parallel.argmax(net, full)
        return cut, full, ours, theirs

    cut, full, (top, best), (want_top, want_best) = both(small.flat)
    assert cut.shape == (1, 9, size)
    np.testing.assert_array_equal(cut, np.asarray(full)[..., ids])
    np.testing.assert_array_equal(top[0], want_top[0])
    np.testing.assert_allclose(top[1], want_top[1], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(best, want_best)
    if k > size:  # the children past the subset: -inf
        assert np.all(np.isneginf(np.asarray(top[1])[..., size:]))


def _subset(seed: int, size: int) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(V, size, replace=False))


CASES = [  # method, options, subset size
    ("chain", dict(gamma=3), 30),
    ("chain", dict(gamma=2), 1),
    ("tree", dict(depth=3, width=2, branch=3, bs=6), 12),
    ("magicdec", dict(gamma=3, sparse="dense"), 40),
    ("tree", dict(depth=3, width=2, branch=3, bs=6), 2),  # branch past the subset
]
FAST = {(0, 0), (1, 0), (2, 1), (3, 2), (4, 0)}  # (case, seed) in the default run


@pytest.mark.parametrize(
    "method,opts,size,seed",
    [
        pytest.param(*c, seed, marks=() if (i, seed) in FAST else pytest.mark.slow)
        for i, c in enumerate(CASES)
        for seed in (0, 1, 2)
    ],
)
def test_every_engine_with_a_cut_head_is_greedy_equal(method, opts, size, seed):
    target = tiny.model(seed)
    draft = with_vocab(tiny.perturbed(target, 0.2, seed + 10), _subset(seed, size))
    ps = tiny.prompts(seed, lengths=(11, 3, 7)[: 1 + seed])  # 1 to 3 ragged rows
    want = generate(target, ps, max_new_tokens=NEW).tokens
    got = generate(target, ps, draft=draft, method=method, max_new_tokens=NEW, **opts)
    assert got.tokens == want


def test_a_subset_without_the_targets_tokens_accepts_nothing_and_the_whole_one_everything():
    target = tiny.model(3)
    ps = tiny.prompts(3)
    want = generate(target, ps, max_new_tokens=NEW).tokens
    emitted = {t for row in want for t in row}
    never = np.setdiff1d(np.arange(V), sorted(emitted))
    none = generate(target, ps, draft=with_vocab(tiny.perturbed(target, 0.0, 1), never),
                    method="chain", gamma=3, max_new_tokens=NEW)  # fmt: skip
    assert none.tokens == want and none.stats["acceptance_length"] == 1.0
    same = with_vocab(tiny.perturbed(target, 0.0, 1), np.arange(V))
    full = generate(target, ps, draft=same, method="chain", gamma=3, max_new_tokens=NEW)
    assert full.tokens == want and full.stats["acceptance_length"] == 4.0


@pytest.mark.parametrize(
    "method,opts",
    [("chain", dict(gamma=3)), pytest.param("tree", dict(depth=2), marks=pytest.mark.slow)],
)
def test_a_feature_draft_with_a_cut_head_is_greedy_equal(method, opts):
    target = tiny.model(4)
    head = with_vocab(random_head(target, seed=2), _subset(4, 25))
    assert vocab_size_of(head) == 25
    ps = tiny.prompts(4)
    want = generate(target, ps, max_new_tokens=NEW).tokens
    assert (
        generate(target, ps, draft=head, method=method, max_new_tokens=NEW, **opts).tokens == want
    )
