"""Drafts that grow token trees (SwiftSpec-style best-first growth), for the tree engines.

    state = draft.init(params, prefill, first_token)
    state = draft.grow(params, state, expansions=d, width=w, branch=k)   # state.tree grows
    state = draft.commit(state, verify_block, path, n_accepted, bonus, feats)  # re-root

(``feats``: the target's states at the verify block for a draft with ``reads``, else None;
``spec.feature_drafts.FeatureTreeDraft`` is the tree form of a feature draft.)

Growth: each expansion runs the draft on the ``w`` best unexpanded leaves (score = sum of draft
log-probs from the root) and adds each leaf's top-``k`` children. The tree is the draft's own
guess; ``acceptance.accept_tree`` keeps the output lossless whatever the tree is.

Evolving tree cache: node i's K/V sit at slot ``root_slot + i`` once the node is expanded.
After a verify, the root and the accepted path move into the prefix (a dense cache's, or a
sparse draft's StreamingLLM ring) and the surviving subtree of the bonus token is compacted
behind it, in one move (``tree.reroot_kv_src`` / ``reroot_kv_dst``); nothing is recomputed. If
the last accepted node was never expanded, its K/V are computed by one extra "catch-up" query
in the next expansion's forward.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from jaxspec.model import vocab_head
from jaxspec.model.kv_cache import Block, KVCache, advance, move
from jaxspec.model.transformer import Net, apply
from jaxspec.pytree import pytree_dataclass
from jaxspec.spec import drafts
from jaxspec.spec import tree as T
from jaxspec.spec.drafts import NgramDraft, NgramState, Prefill, Streaming, prompt_cache
from jaxspec.spec.feature_drafts import FeatureDraft, FeatureTreeDraft
from jaxspec.spec.sampling import Sampling


@pytree_dataclass
class ModelTreeState:
    cache: KVCache  # length == root slot
    tree: T.Tree
    expanded: Bool[Array, "b n"]  # children added (a full tree can run a node and add none)
    has_kv: Bool[Array, "b n"]  # the draft ran on the node: its K/V are in its slot
    seen: Int[Array, " b"]  # RoPE position of the root
    catchup: Int[Array, " b"]  # token whose K/V the next grow must compute
    catchup_slot: Int[Array, " b"]  # where they go (NO_SLOT: none)
    carried: Int[Array, " b"]  # tree nodes kept across re-roots so far (their KV not recomputed)
    recomputed: Int[Array, " b"]  # nodes run again although their K/V were already computed


@dataclasses.dataclass(frozen=True)
class ModelTreeDraft:
    net: Net
    capacity: int  # tree nodes, root included
    sparse: Streaming | None = None
    reuse_target_cache: bool = False
    reads = None  # the target states a draft takes (feature drafts); a model reads none

    def init(self, params, pre: Prefill, first_token) -> ModelTreeState:
        b = pre.ids.shape[0]
        # block room: every tree node, root included, owns a slot after the (sparse) prefix
        cache = prompt_cache(self, params, pre, room=self.capacity + 1)
        n = self.capacity
        none = jnp.full((b,), T.NO_SLOT, jnp.int32)
        return ModelTreeState(
            cache,
            T.new_tree(first_token, n),
            jnp.zeros((b, n), bool),
            jnp.zeros((b, n), bool),
            pre.lens,
            jnp.zeros((b,), jnp.int32),
            none,
            jnp.zeros((b,), jnp.int32),
            jnp.zeros((b,), jnp.int32),
        )

    def grow(self, params, s: ModelTreeState, *, expansions: int, width: int, branch: int):
        cache, tree, expanded, has_kv = s.cache, s.tree, s.expanded, s.has_kv
        recomputed = s.recomputed
        b, n = expanded.shape
        for e in range(expansions):
            leaves = T.best_leaves(tree, width, expanded)
            # run only leaves whose children fit: a node run without adding children would
            # have to run again later (its K/V recomputed)
            room = (tree.capacity - tree.size) // branch
            leaves = jnp.where(jnp.arange(width)[None, :] < room[:, None], leaves, -1)
            tokens, block = T.expand_layout(tree, leaves, cache.length, s.seen)
            if e == 0:  # the catch-up query: sees the prefix (its own slot included)
                tokens = jnp.concatenate([s.catchup[:, None], tokens], 1)
                block = Block(
                    positions=jnp.concatenate([(s.seen - 1)[:, None], block.positions], 1),
                    slots=jnp.concatenate([s.catchup_slot[:, None], block.slots], 1),
                    block_mask=jnp.concatenate([jnp.zeros((b, 1, n), bool), block.block_mask], 1),
                )
            logits, cache = apply(self.net, params, tokens, cache, block, subset=True)
            child_tok, child_lp = vocab_head.top_log_probs(
                self.net, params, logits[:, 1:] if e == 0 else logits, branch
            )
            tree, new_ids = T.add_children(tree, leaves, child_tok, child_lp)
            ran = jnp.arange(n)[None, None, :] == leaves[:, :, None]  # [b, w, n]
            recomputed = recomputed + jnp.sum(
                jnp.any(ran, axis=1) & has_kv, axis=1, dtype=jnp.int32
            )
            has_kv = has_kv | jnp.any(ran, axis=1)
            got_children = jnp.any(new_ids >= 0, axis=2)  # [b, w]
            expanded = expanded | jnp.any(ran & got_children[:, :, None], axis=1)
        none = jnp.full((b,), T.NO_SLOT, jnp.int32)
        return dataclasses.replace(
            s,
            cache=cache,
            tree=tree,
            expanded=expanded,
            has_kv=has_kv,
            catchup_slot=none,
            recomputed=recomputed,
        )

    def commit(self, s: ModelTreeState, tb: T.TreeBlock, path, n_acc, bonus, feats=None):
        b = n_acc.shape[0]
        rows = jnp.arange(b)
        nodes = T.path_nodes(tb, path)
        last = jnp.where(
            n_acc > 0,
            jnp.take_along_axis(nodes, jnp.maximum(n_acc - 1, 0)[:, None], 1)[:, 0],
            0,
        )
        need = ~s.has_kv[rows, last]
        last_token = s.tree.token[rows, last]
        seen = s.seen + 1 + n_acc
        # evolving tree cache, dense or sparse: the root and the accepted path join the prefix
        # (a dense cache's, or the ring), the bonus token's subtree is kept behind it
        tree, keep_src, n_kept = T.reroot(s.tree, nodes, n_acc, bonus)
        src, count, _ = T.reroot_kv_src(s.cache.length, nodes, n_acc, keep_src)
        dst, length = T.reroot_kv_dst(
            s.cache.length, s.seen, n_acc, count, src.shape[1], self.sparse
        )
        cache = move(s.cache, src, dst, length, mode=self.net.kernels.fused_commit)
        kept = keep_src >= 0
        follow = jnp.maximum(keep_src, 0)
        expanded = jnp.take_along_axis(s.expanded, follow, 1) & kept
        has_kv = jnp.take_along_axis(s.has_kv, follow, 1) & kept
        slot = length - 1 if self.sparse is None else self.sparse.ring_slot(seen - 1)
        catchup_slot = jnp.where(need, slot, T.NO_SLOT).astype(jnp.int32)
        return ModelTreeState(
            cache,
            tree,
            expanded,
            has_kv,
            seen,
            last_token,
            catchup_slot,
            s.carried + n_kept,
            s.recomputed,
        )

    def shifted(self, s: ModelTreeState, k: int) -> ModelTreeState:
        """A dense cache ``k`` tokens further on (measurements time units mid-context); a
        sparse cache keeps its fixed budget."""
        if self.sparse is not None:
            return s
        cache = advance(s.cache, jnp.full_like(s.seen, k))
        return dataclasses.replace(s, cache=cache, seen=s.seen + k)

    def keep_alive(self, s: ModelTreeState, extra) -> ModelTreeState:
        return s  # the expansions' K/V are in the state already


@pytree_dataclass
class NgramTreeState:
    lookup: NgramState
    tree: T.Tree


@dataclasses.dataclass(frozen=True)
class NgramTreeDraft:
    """Prompt lookup as a tree: one path of ``expansions`` looked-up tokens."""

    ngram: NgramDraft
    capacity: int
    reads = None

    def init(self, params, pre: Prefill, first_token) -> NgramTreeState:
        return NgramTreeState(
            self.ngram.init(params, pre, first_token), T.new_tree(first_token, self.capacity)
        )

    def grow(self, params, s: NgramTreeState, *, expansions: int, width: int, branch: int):
        toks, _, _ = self.ngram.propose(None, s.lookup, None, expansions, Sampling())
        root = jnp.zeros((toks.shape[0],), jnp.int32)
        tree = T.add_path(s.tree, root, toks, jnp.zeros(toks.shape, jnp.float32))
        return dataclasses.replace(s, tree=tree)

    def commit(self, s: NgramTreeState, tb: T.TreeBlock, path, n_acc, bonus, feats=None):
        chain = s.tree.token[:, 1:]  # nodes 1.. are the looked-up path, in order
        lookup = self.ngram.commit(s.lookup, chain, n_acc, bonus)
        return NgramTreeState(lookup, T.new_tree(bonus, self.capacity))

    def shifted(self, s: NgramTreeState, k: int) -> NgramTreeState:
        return s

    def keep_alive(self, s: NgramTreeState, extra) -> NgramTreeState:
        return NgramTreeState(self.ngram.keep_alive(s.lookup, extra), s.tree)


def resolve(target, draft, *, capacity: int, depth: int, kernels=None, sharded=None, **budget):
    """``draft=`` -> (tree draft, params), by the chain drafts' resolution and checks."""
    d, params = drafts.resolve(target, draft, "tree", kernels=kernels, sharded=sharded, **budget)
    return tree_form(d, capacity, depth), params


def tree_form(d, capacity: int, depth: int):
    """The tree-growing form of a resolved chain draft: the same model and cache kind (or the
    same prompt lookup, or feature head), trees of ``capacity`` nodes grown by at most
    ``depth`` expansions."""
    if isinstance(d, NgramDraft):
        return NgramTreeDraft(d, capacity)
    if isinstance(d, FeatureDraft):
        return FeatureTreeDraft(d.net, d.reads, capacity, depth)
    return ModelTreeDraft(d.net, capacity, d.sparse, d.reuse_target_cache)
