"""The cache commit in one kernel (pallas_kernels/kv_commit.py) against the plain gather and
scatter, and the tree engine committing through it.

On CPU the kernel runs through the Pallas interpreter. The moves are pure data movement, so the
results must be equal to the bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
import jaxspec.model.kv_cache as kvc
from jaxspec.errors import OptionError
from jaxspec.kernels import KernelConfig
from pallas_kernels import kv_commit as K
from tests import tiny

INTERPRET = jax.default_backend() != "gpu"


def _moves(rng, b, s, k):
    """Per row: a root at ``length`` then an accepted path of increasing block slots (as a tree
    verify commits), ragged counts, one row committing nothing, one near the capacity."""
    length = rng.integers(0, s - 2 * k, b)
    length[-1] = s - k // 2  # some destinations past the capacity: dropped
    rel = np.zeros((b, k), np.int64)
    for r in range(b):
        rel[r, 1:] = np.sort(rng.choice(np.arange(1, 2 * k), k - 1, replace=False))
    rel[0, :4] = [0, 2, 3, 4]  # slot L+2 is read for L+1 and written from L+3
    count = rng.integers(1, k + 1, b)
    count[0], count[1 % b] = k, 0
    keep = np.arange(k)[None, :] < count[:, None]
    src = (length[:, None] + rel).astype(np.int32)
    dst = np.where(keep, length[:, None] + np.arange(k), np.iinfo(np.int32).max).astype(np.int32)
    return jnp.asarray(src), jnp.asarray(dst)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("b, s, kh, hd, k, n", [(3, 40, 3, 64, 6, 4), (2, 33, 2, 8, 9, 3)])
def test_matches_the_gather_and_scatter(b, s, kh, hd, k, n, dtype):
    rng = np.random.default_rng(b * 10 + k)
    caches = [jnp.asarray(rng.normal(size=(b, s, kh, hd)), dtype) for _ in range(n)]
    src, dst = _moves(rng, b, s, k)
    want = K.reference(caches, src, dst)
    got = K.move_rows([jnp.array(x) for x in caches], src, dst, interpret=INTERPRET)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    # the case is the hazardous one: stores that overtook loads (here: rows moved last first,
    # in place) give another result, which is what the kernel's barrier rules out
    rev = np.asarray(caches[0], np.float32).copy()
    for i in reversed(range(k)):
        for r in range(b):
            if dst[r, i] < s:
                rev[r, dst[r, i]] = rev[r, src[r, i]]
    assert not np.array_equal(rev, np.asarray(want[0], np.float32))


def _copy(cache):
    return jax.tree.map(jnp.array, cache)


def test_dispatch(monkeypatch):
    rng = np.random.default_rng(1)
    cache = kvc.init_cache(tiny.CFG, 2, 16)
    cache = kvc.KVCache(
        k=[jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in cache.k],
        v=[jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in cache.v],
        length=jnp.asarray([3, 9], jnp.int32),
    )
    src = jnp.asarray([[3, 5, 6], [9, 10, 12]], jnp.int32)
    count = jnp.asarray([3, 2], jnp.int32)
    calls = []
    real = K.move_rows
    monkeypatch.setattr(K, "move_rows", lambda *a, **k: calls.append(k) or real(*a, **k))
    plain = kvc.commit(_copy(cache), src, count)
    assert not calls  # mode "off" (the default): a gather and a scatter
    fused = kvc.commit(_copy(cache), src, count, mode="interpret")
    assert calls == [{"interpret": True}]
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(plain.length, [6, 11])
    # the StreamingLLM ring commits through the same move: with 2 sinks and a 5-slot window,
    # row 1 (9 tokens seen) wraps its 2 tokens to slots 2 + (9 - 2) % 5 = 4 and 5
    from jaxspec.spec.drafts import Streaming

    ring, seen = Streaming(sinks=2, window=5), jnp.asarray([3, 9], jnp.int32)
    calls.clear()
    plain = kvc.commit_ring(_copy(cache), src, count, seen, ring)
    fused = kvc.commit_ring(_copy(cache), src, count, seen, ring, mode="interpret")
    assert calls == [{"interpret": True}]
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(plain.length, [6, 7])
    np.testing.assert_array_equal(plain.k[0][1, 4], cache.k[0][1, 9])
    np.testing.assert_array_equal(plain.k[0][1, 5], cache.k[0][1, 10])
    # where the mode comes from: the resolved config (off on CPU, the kernel on a GPU)
    assert KernelConfig().resolve(tiny.CFG, backend="cpu").fused_commit == "off"
    assert KernelConfig().resolve(tiny.CFG, backend="gpu").fused_commit == "pallas"
    assert (
        KernelConfig(fused_commit="interpret").resolve(tiny.CFG, sharded=True).fused_commit == "off"
    )
    with pytest.raises(OptionError, match="fused_commit must be one of"):
        KernelConfig(fused_commit="fast")
    with pytest.raises(OptionError, match="JAXSPEC_FUSED_COMMIT must be one of"):
        KernelConfig.from_env({"JAXSPEC_FUSED_COMMIT": "fast"})


def test_tree_decoding_commits_through_the_kernel(monkeypatch):
    """Greedy tokens (float32) of the tree engine with a model draft (the target's and the
    draft's caches both commit) equal the plain commit's, and the autoregressive tokens."""
    from jaxspec.engines import programs

    target = tiny.model(4)
    draft = tiny.perturbed(target, 0.3, 4)
    prompts = tiny.prompts(4, lengths=(9, 4))
    ar = jaxspec.generate(target, prompts, max_new_tokens=10).tokens
    calls = []
    real = K.move_rows
    monkeypatch.setattr(K, "move_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    runs = {}
    for mode in ("off", "interpret"):
        programs._COMPILED.clear()  # so the spy sees this run's traces
        jax.clear_caches()
        runs[mode] = jaxspec.generate(
            target, prompts, max_new_tokens=10, method="tree", draft=draft,
            depth=3, width=3, branch=2, bs=6, kernels=KernelConfig(fused_commit=mode),
        )  # fmt: skip
        assert bool(calls) == (mode == "interpret")
    programs._COMPILED.clear()
    jax.clear_caches()
    assert runs["interpret"].tokens == runs["off"].tokens == ar
    assert runs["interpret"].stats["acceptance_length"] == runs["off"].stats["acceptance_length"]
