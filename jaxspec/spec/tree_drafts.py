"""Drafts that grow token trees (SwiftSpec-style best-first growth), for the tree engines.

    state = draft.init(params, prefill, first_token)
    state = draft.grow(params, state, expansions=d, width=w, branch=k)   # state.tree grows
    state = draft.commit(state, verify_block, path, n_accepted, bonus)  # re-root

Growth: each expansion runs the draft on the ``w`` best unexpanded leaves (score = sum of draft
log-probs from the root) and adds each leaf's top-``k`` children. The tree is the draft's own
guess; ``acceptance.accept_tree`` keeps the output lossless whatever the tree is.

Evolving tree cache (dense model drafts): node i's K/V sit at slot ``root_slot + i`` once the
node is expanded. After a verify, the root and the accepted path move into the prefix and the
surviving subtree of the bonus token is compacted behind it with one gather
(``tree.reroot_kv_src``); nothing is recomputed. If the last accepted node was never expanded,
its K/V are computed by one extra "catch-up" query in the next expansion's forward. A streaming
(sparse) draft commits the path into its ring and starts a fresh tree.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from jaxspec.config import ModelConfig
from jaxspec.model.kv_cache import Block, KVCache, commit
from jaxspec.model.transformer import apply
from jaxspec.pytree import pytree_dataclass
from jaxspec.spec import tree as T
from jaxspec.spec.acceptance import top_children
from jaxspec.spec.drafts import NgramDraft, NgramState, Prefill, Streaming, prompt_cache
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
    graphdef: object
    cfg: ModelConfig
    capacity: int  # tree nodes, root included
    sparse: Streaming | None = None
    reuse_target_cache: bool = False

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
            logits, cache = apply(self.graphdef, params, tokens, cache, block)
            logp = jax.nn.log_softmax(logits[:, 1:] if e == 0 else logits, axis=-1)
            child_tok, child_lp = top_children(logp, branch)
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

    def commit(self, s: ModelTreeState, tb: T.TreeBlock, path, n_acc, bonus) -> ModelTreeState:
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
        if self.sparse is None:
            tree, keep_src, n_kept = T.reroot(s.tree, nodes, n_acc, bonus)
            src, count, new_root = T.reroot_kv_src(s.cache.length, nodes, n_acc, keep_src)
            cache = commit(s.cache, src, count)
            cache.length = new_root
            kept = keep_src >= 0
            follow = jnp.maximum(keep_src, 0)
            expanded = jnp.take_along_axis(s.expanded, follow, 1) & kept
            has_kv = jnp.take_along_axis(s.has_kv, follow, 1) & kept
            slot = new_root - 1
        else:
            n_kept = jnp.zeros_like(n_acc)
            sp = self.sparse
            m = nodes.shape[1] + 1
            i = jnp.arange(m)[None, :]
            rel = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.maximum(nodes, 0)], 1)
            src = s.cache.length[:, None] + rel
            dst = jnp.where(i <= n_acc[:, None], sp.ring_slot(s.seen[:, None] + i), T.NO_SLOT)

            def move(x):
                return x.at[rows[:, None], dst].set(
                    x[rows[:, None], jnp.clip(src, 0, x.shape[1] - 1)], mode="drop"
                )

            cache = KVCache(
                [move(x) for x in s.cache.k],
                [move(x) for x in s.cache.v],
                jnp.minimum(seen, sp.budget).astype(jnp.int32),
            )
            tree = T.new_tree(bonus, self.capacity)
            expanded = jnp.zeros_like(s.expanded)
            has_kv = expanded
            slot = sp.ring_slot(seen - 1)
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


@pytree_dataclass
class NgramTreeState:
    lookup: NgramState
    tree: T.Tree


@dataclasses.dataclass(frozen=True)
class NgramTreeDraft:
    """Prompt lookup as a tree: one path of ``expansions`` looked-up tokens."""

    ngram: NgramDraft
    capacity: int

    def init(self, params, pre: Prefill, first_token) -> NgramTreeState:
        return NgramTreeState(
            self.ngram.init(params, pre, first_token), T.new_tree(first_token, self.capacity)
        )

    def grow(self, params, s: NgramTreeState, *, expansions: int, width: int, branch: int):
        toks, _, _ = self.ngram.propose(None, s.lookup, None, expansions, Sampling())
        tree = s.tree
        parent = jnp.zeros((toks.shape[0], 1), jnp.int32)
        for i in range(expansions):
            zero = jnp.zeros((toks.shape[0], 1, 1), jnp.float32)
            tree, new = T.add_children(tree, parent, toks[:, i, None, None], zero)
            parent = new[:, :, 0]
        return dataclasses.replace(s, tree=tree)

    def commit(self, s: NgramTreeState, tb: T.TreeBlock, path, n_acc, bonus) -> NgramTreeState:
        chain = s.tree.token[:, 1:]  # nodes 1.. are the looked-up path, in order
        lookup = self.ngram.commit(s.lookup, chain, n_acc, bonus)
        return NgramTreeState(lookup, T.new_tree(bonus, self.capacity))


def resolve(target, draft, *, capacity: int, budget: int = 256, sinks: int = 4, ngram: int = 3):
    """``draft=`` -> (tree draft, params), reusing the chain drafts' checks."""
    from jaxspec.spec import drafts

    d, params = drafts.resolve(target, draft, "tree", budget=budget, sinks=sinks, ngram=ngram)
    if isinstance(d, NgramDraft):
        return NgramTreeDraft(d, capacity), params
    return ModelTreeDraft(d.graphdef, d.cfg, capacity, d.sparse, d.reuse_target_cache), params
