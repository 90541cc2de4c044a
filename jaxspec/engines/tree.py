"""Serial tree speculation (SpecExec-style; the baseline SwiftSpec overlaps): the draft grows a
tree by best-first expansion, the target verifies its best ``bs`` nodes in one tree-masked
forward, ``accept_tree`` keeps the longest path the target's own draws follow plus one token,
and both caches commit/re-root without recompute. The whole loop runs on device."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from jaxspec.engines.base import (
    execute,
    is_eos,
    prefill,
    spec_chunk,
    speculative_stats,
    until_done,
)
from jaxspec.engines.chain import emit
from jaxspec.engines.options import positive_int, reject_unknown
from jaxspec.model.kv_cache import KVCache, commit, init_cache
from jaxspec.model.transformer import apply
from jaxspec.pytree import pytree_dataclass
from jaxspec.spec import drafts, tree_drafts
from jaxspec.spec import tree as T
from jaxspec.spec.acceptance import accept_tree, accept_tree_greedy
from jaxspec.spec.sampling import Sampling, probs, sample


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """Best-first growth: ``depth`` expansions of the ``width`` best leaves, ``branch`` children
    each; the target verifies the best ``bs`` nodes (SwiftSpec: bs = w = 8)."""

    depth: int = 4
    width: int = 8
    branch: int = 4
    bs: int = 8

    @property
    def capacity(self) -> int:
        return 1 + self.depth * self.width * self.branch

    @classmethod
    def from_options(cls, options: dict) -> TreeShape:
        d = cls()
        return cls(
            depth=positive_int("depth", options.pop("depth", d.depth), maximum=32),
            width=positive_int("width", options.pop("width", d.width), maximum=64),
            branch=positive_int("branch", options.pop("branch", d.branch), maximum=16),
            bs=positive_int("bs", options.pop("bs", d.bs), maximum=128),
        )


@pytree_dataclass
class State:
    cache: KVCache  # target; length == slot of the root (last emitted token)
    out: Int[Array, "b m"]
    count: Int[Array, " b"]
    done: Bool[Array, " b"]
    steps: Int[Array, ""]
    emitted: Int[Array, " b"]
    live_steps: Int[Array, " b"]
    draft: object
    key: jax.Array


def init_state(
    tparams, dparams, ids, lens, key, *, graphdef, cfg, draft, max_new, capacity, sampling, eos
) -> State:
    b = ids.shape[0]
    dtype = jax.tree.leaves(tparams)[0].dtype
    cache = init_cache(cfg, b, capacity, dtype)
    logits, cache = prefill(graphdef, tparams, cache, ids, lens, vocab=cfg.vocab_size)
    key, sub = jax.random.split(key)
    tok = sample(sub, logits, sampling)
    dstate = draft.init(dparams, drafts.Prefill(ids, lens, cache, capacity, draft.capacity), tok)
    out = jnp.zeros((b, max_new), jnp.int32).at[:, 0].set(tok)
    zero = jnp.zeros((b,), jnp.int32)
    return State(
        cache,
        out,
        zero + 1,
        is_eos(tok, eos) | (max_new <= 1),
        jnp.zeros((), jnp.int32),
        zero,
        zero,
        dstate,
        key,
    )


@pytree_dataclass
class Verified:
    """A verify's outcome: accepted block slots, their number, the next token, and the target's
    output bookkeeping with the root and the accepted path committed."""

    path: Int[Array, "b m"]
    n: Int[Array, " b"]
    next: Int[Array, " b"]
    cache: KVCache
    out: Int[Array, "b o"]
    count: Int[Array, " b"]
    done: Bool[Array, " b"]
    live: Bool[Array, " b"]  # rows that were live before this verify


def verify_and_commit(
    tparams,
    cache: KVCache,
    tb: T.TreeBlock,
    key,
    out,
    count,
    done,
    *,
    graphdef,
    sampling: Sampling,
    eos,
) -> Verified:
    """One target forward over the verify block ``tb``, the lossless tree rule (greedy: argmax
    walk; sampling: ``accept_tree``), the emitted tokens appended to live rows (EOS and length
    limits respected), and the root plus the accepted path committed to the target cache.
    Shared by the serial tree engine and SwiftSpec's target worker."""
    logits, cache = apply(graphdef, tparams, tb.tokens, cache, tb.block)
    if sampling.greedy:
        target_tokens = jnp.argmax(logits, -1).astype(jnp.int32)
        path, n, nxt = accept_tree_greedy(tb.tokens, tb.parent, tb.valid, target_tokens)
    else:
        path, n, nxt = accept_tree(key, tb.tokens, tb.parent, tb.valid, probs(logits, sampling))
    new = jnp.concatenate(
        [jnp.take_along_axis(tb.tokens, jnp.maximum(path, 0), 1), jnp.zeros_like(nxt)[:, None]], 1
    )
    new = jnp.where(jnp.arange(new.shape[1])[None, :] == n[:, None], nxt[:, None], new)
    live = ~done
    out, count, done, _ = emit(out, count, done, new, n + 1, eos)
    src, cnt = T.verify_commit_src(cache.length, path, n)
    cache = commit(cache, src, jnp.where(live, cnt, 0))
    return Verified(path, n, nxt, cache, out, count, done, live)


def step(tparams, dparams, s: State, *, graphdef, draft, shape: TreeShape, sampling, eos):
    key, k_verify = jax.random.split(s.key)
    dstate = draft.grow(
        dparams, s.draft, expansions=shape.depth, width=shape.width, branch=shape.branch
    )
    idx, cnt = T.select_subtree(dstate.tree, shape.bs)
    tb = T.verify_layout(dstate.tree, idx, cnt, s.cache.length, s.cache.length)
    v = verify_and_commit(
        tparams,
        s.cache,
        tb,
        k_verify,
        s.out,
        s.count,
        s.done,
        graphdef=graphdef,
        sampling=sampling,
        eos=eos,
    )
    dstate = draft.commit(dstate, tb, v.path, v.n, v.next)
    emitted = s.emitted + jnp.where(v.live, v.n + 1, 0)
    return State(
        v.cache, v.out, v.count, v.done, s.steps + 1, emitted, s.live_steps + v.live, dstate, key
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "cfg",
        "draft",
        "shape",
        "max_new",
        "capacity",
        "sampling",
        "eos",
        "chunk",
    ),
)
def decode(
    tparams,
    dparams,
    ids,
    lens,
    key,
    *,
    graphdef,
    cfg,
    draft,
    shape,
    max_new,
    capacity,
    sampling,
    eos,
    chunk=1,
):
    s = init_state(
        tparams,
        dparams,
        ids,
        lens,
        key,
        graphdef=graphdef,
        cfg=cfg,
        draft=draft,
        max_new=max_new,
        capacity=capacity,
        sampling=sampling,
        eos=eos,
    )
    s = until_done(
        lambda s: step(
            tparams,
            dparams,
            s,
            graphdef=graphdef,
            draft=draft,
            shape=shape,
            sampling=sampling,
            eos=eos,
        ),
        s,
        chunk,
    )
    return s.out, s.count, s.steps, s.emitted, s.live_steps


OPTIONS = ("depth", "width", "branch", "bs", "budget", "sinks", "ngram")


def run(target, draft, ids, lens, *, max_new, sampling, eos, seed, prompts, **options):
    reject_unknown("tree", options, OPTIONS)
    shape = TreeShape.from_options(options)
    d, dparams = tree_drafts.resolve(target, draft, capacity=shape.capacity, **options)
    capacity = ids.shape[1] + max_new + shape.capacity + 2
    static = dict(
        graphdef=target.graphdef,
        cfg=target.config,
        draft=d,
        shape=shape,
        max_new=max_new,
        capacity=capacity,
        sampling=sampling,
        eos=eos,
        chunk=spec_chunk(ids.shape[0]),
    )
    key = jax.random.key(seed)
    (out, count, steps, emitted, live), wall_s, compile_s = execute(
        decode, target.params, dparams, ids, lens, key, **static
    )
    stats = {
        **speculative_stats(
            steps, emitted, live, wall_s=wall_s, compile_s=compile_s, draft_per_step=shape.depth
        ),
        **dataclasses.asdict(shape),
    }
    return out, count, stats
