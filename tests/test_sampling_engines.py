"""Sampling through the chain and tree engines reproduces the target's distribution exactly:
the joint law of the first three new tokens against exact enumeration, chi-square at a fixed
seed, with a negative control (a rule that accepts every draft token) that the test rejects;
with a draft model, with one whose head covers half the vocabulary (``model.vocab_head``) and
with a feature draft (an EAGLE head over the target's states)."""

import functools
import itertools
import math

import jax
import numpy as np
import pytest

from jaxspec.api import generate
from jaxspec.engines import chain as chain_engine
from jaxspec.engines import programs
from jaxspec.engines import tree as tree_engine
from jaxspec.model.feature_head import random_head
from jaxspec.model.vocab_head import with_vocab
from jaxspec.spec.sampling import Sampling, draw, probs
from tests import tiny

V = 6
PROMPT = [1, 4, 2, 5]
SAMPLING = dict(temperature=0.9, top_p=0.95)
ROWS, CALLS = 2000, 4


@functools.cache
def exact_joint() -> np.ndarray:
    """p(t1, t2, t3 | prompt) of the tests' target (``models``'s) by enumeration with the full
    forward: the 1 + V + V^2 prefixes in three batched calls, once per module (every test
    compares with the same law; its compiles are not what a test checks)."""
    target, s = _target(), Sampling(**SAMPLING)
    pairs = list(itertools.product(range(V), repeat=2))
    p1 = np.asarray(probs(target.logits([PROMPT])[:, -1], s))[0]
    p2 = np.asarray(probs(target.logits([PROMPT + [a] for a in range(V)])[:, -1], s))
    p3 = np.asarray(probs(target.logits([PROMPT + [a, b] for a, b in pairs])[:, -1], s))
    joint = p1[:, None, None] * p2[:, :, None] * p3.reshape(V, V, V)
    return joint.astype(np.float64)


def sampled_joint(target, draft, method, **opts) -> np.ndarray:
    counts = np.zeros((V, V, V))
    for seed in range(CALLS):
        r = generate(
            target,
            [PROMPT] * ROWS,
            draft=draft,
            method=method,
            max_new_tokens=3,
            seed=seed,
            **SAMPLING,
            **opts,
        )
        for t in r.tokens:
            counts[tuple(t)] += 1
    return counts


def chi_square_rejects(counts: np.ndarray, expected_p: np.ndarray) -> tuple[bool, float, float]:
    """Pool cells with expected count < 5; critical value at alpha = 1e-4 (Wilson-Hilferty)."""
    n = counts.sum()
    exp = expected_p.reshape(-1) * n
    obs = counts.reshape(-1)
    assert obs[exp == 0].sum() == 0, "a token the target cannot emit was emitted"
    small = exp < 5
    o = np.append(obs[~small], obs[small].sum())
    e = np.append(exp[~small], exp[small].sum())
    keep = e > 0
    o, e = o[keep], e[keep]
    stat = float((((o - e) ** 2) / e).sum())
    k = int(keep.sum()) - 1
    z = 3.719  # one-sided normal quantile for 1e-4
    crit = k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3
    return stat > crit, stat, crit


def _target():
    return tiny.model(3, vocab_size=V)


def models(kind: str = "model"):
    target = _target()
    if kind == "feature":
        return target, random_head(target, seed=9)
    draft = tiny.perturbed(target, 0.6, 9)
    if kind == "model-vocab":  # the draft proposes 3 of the 6 tokens; the target emits all 6
        return target, with_vocab(draft, np.array([0, 2, 5]))
    return target, draft


KINDS = ["model", pytest.param("feature", marks=pytest.mark.slow)]  # a minute of CPU a test


def accept_everything_chain(key, x, q, p):
    return jax.numpy.full(x.shape[:1], x.shape[1], jax.numpy.int32), draw(key, p[:, -1])


@pytest.fixture(autouse=True)
def fresh_compiles():
    programs._COMPILED.clear()
    jax.clear_caches()
    yield
    programs._COMPILED.clear()
    jax.clear_caches()


@pytest.mark.parametrize("kind", [*KINDS, "model-vocab"])  # model-vocab: a cut draft head
@pytest.mark.parametrize(
    "method,opts",
    [("chain", dict(gamma=2)), ("tree", dict(depth=2, width=2, branch=2, bs=4))],
)
def test_sampling_matches_target_distribution(method, opts, kind):
    target, draft = models(kind)
    rejects, stat, crit = chi_square_rejects(
        sampled_joint(target, draft, method, **opts), exact_joint()
    )
    assert not rejects, (stat, crit)


def test_autoregressive_sampling_matches_target_distribution():
    target, _ = models()
    counts = sampled_joint(target, None, "autoregressive")
    rejects, stat, crit = chi_square_rejects(counts, exact_joint())
    assert not rejects, (stat, crit)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ["chain", "tree"])
def test_negative_control_always_accept_is_rejected(method, monkeypatch, kind):
    target, draft = models(kind)
    if method == "chain":
        monkeypatch.setattr(chain_engine, "accept_chain", accept_everything_chain)
        opts = dict(gamma=2)
    else:

        def always_first_child(key, tokens, parent, valid, p):
            b, t = tokens.shape
            # accept every slot of the (chain-shaped) tree, then draw from the last p
            path = jax.numpy.broadcast_to(jax.numpy.arange(1, t), (b, t - 1)).astype(
                jax.numpy.int32
            )
            n = jax.numpy.sum(valid[:, 1:], axis=1).astype(jax.numpy.int32)
            return path, n, draw(key, p[:, -1])

        monkeypatch.setattr(tree_engine, "accept_tree", always_first_child)
        opts = dict(depth=2, width=1, branch=1, bs=2)
    rejects, stat, crit = chi_square_rejects(
        sampled_joint(target, draft, method, **opts), exact_joint()
    )
    assert rejects, (stat, crit)


def test_enumeration_covers_every_sequence():
    assert exact_joint().sum() == pytest.approx(1.0, abs=1e-5)
    assert len(list(itertools.product(range(V), repeat=3))) == V**3
