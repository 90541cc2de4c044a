"""Feature drafts (EAGLE): a head over the target's hidden states drafts chains and trees.

The head (``model.feature_head``) runs on pairs ``(f_t, x_{t+1})``: a state and the token after
it. Its cache holds, at slot and position t, the pair of the target's *own* state ``f_t``: the
head's input is exact wherever the target has run. Drafting goes ahead of the target on the
head's own recurrent states: draft step 1 reads the target's newest state, step k > 1 reads
``g``, the head's prediction one step before.

Pending pairs: after a verify, the target's states at the verified block slots pair with the
tokens it accepted and its next token (``n + 1`` pairs for ``n`` accepted). They enter the
head's cache at the next draft's first forward (one ragged block, like a model draft's pending
tokens), which also yields the first draft distribution. The head's K/V of drafted positions
were computed from its own states, so they are never kept: the cache follows the accepted path
with the target's states, as EAGLE recomputes it. The cache is dense (the head has one layer:
its reads are a small share of the target's, so a sparse budget would save little).

Chains (``FeatureDraft``): ``init / propose / commit`` as ``spec.drafts``. Trees
(``FeatureTreeDraft``): ``init / grow / commit`` as ``spec.tree_drafts``: the first expansion
is the pending block (its last pair is the root's: its output gives the root's children and the
root's state), each later one runs the best ``width`` leaves, each leaf's input being its
parent's predicted state; the tree restarts at the bonus token after every verify.

Both read the target's states through ``reads`` (``transformer.apply``'s ``features``): the
engines ask the target's prefill and verify for them only when the draft has ``reads``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxspec.model import vocab_head
from jaxspec.model.feature_head import apply_head, fuse_states, head_prefill
from jaxspec.model.kv_cache import Block, KVCache, advance, causal_block, init_cache
from jaxspec.model.transformer import Net
from jaxspec.pytree import pytree_dataclass
from jaxspec.spec import tree as T
from jaxspec.spec.sampling import Sampling, probs, sample


@pytree_dataclass
class Pending:
    """The head's cache (pairs of the target's states, committed) and the pairs not yet in it:
    ``tokens[b, i]`` follows the target states ``feats[b, i]`` (at the head's reads: ``r`` is
    their count times the hidden size), for ``i < count[b]``."""

    cache: KVCache
    tokens: Int[Array, "b p"]
    feats: Float[Array, "b p r"]
    count: Int[Array, " b"]


def start(net: Net, params, pre, first_token, width: int, room: int) -> Pending:
    """The head's cache over the prompt (``pre.features``: the target's prompt states) and the
    last prompt state pending with the first new token; ``width`` pending slots, ``room`` cache
    slots past the engine's capacity (the pending block and the drafted positions)."""
    b, w = pre.ids.shape
    cache = init_cache(net.cfg, b, pre.capacity + room, net.dtype)
    cache = head_prefill(net, params, cache, pre.ids, pre.features, pre.lens)
    last = jnp.take_along_axis(pre.features, jnp.maximum(pre.lens - 1, 0)[:, None, None], 1)
    feats = jnp.zeros((b, width, last.shape[-1]), last.dtype).at[:, :1].set(last)
    tokens = jnp.zeros((b, width), jnp.int32).at[:, 0].set(first_token)
    return Pending(cache, tokens, feats, jnp.ones((b,), jnp.int32))


def feed(net: Net, params, p: Pending, subset: bool = False):
    """The pending pairs as one ragged block: ``(logits [b, v], g [b, 1, d], cache)`` of the
    last pending pair (the first draft distribution and state), its K/V written; ``subset``
    as ``transformer.apply``'s. The pending states are the target's at the head's reads, fused
    here (a fused-reads head's ``fuse``) once a round."""
    length = p.cache.length
    block = causal_block(length, length, p.count, p.tokens.shape[1])
    feats = fuse_states(net, params, p.feats)
    logits, g, cache = apply_head(
        net, params, p.tokens, feats, p.cache, block, (p.count - 1)[:, None], subset
    )
    return logits[:, 0], g, cache


def pend(p: Pending, cache: KVCache, tokens, feats, count) -> Pending:
    """``p``'s pairs committed to ``cache``; ``count[b]`` new pairs ``(feats, tokens)`` (at most
    ``p``'s width) pending."""
    width = p.tokens.shape[1]
    pad = width - tokens.shape[1]
    tokens = jnp.pad(tokens, ((0, 0), (0, pad)))[:, :width]
    feats = jnp.pad(feats, ((0, 0), (0, pad), (0, 0)))[:, :width].astype(p.feats.dtype)
    return Pending(advance(cache, p.count), tokens, feats, count.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class FeatureDraft:
    """Chains from a feature head (the module docstring). ``reads``: the target states it
    needs; ``sparse``: always None (a dense cache)."""

    net: Net
    reads: tuple[int, ...]
    sparse: None = None

    def init(self, params, pre, first_token) -> Pending:
        # pending: up to gamma + 1 pairs (pre.room = gamma + 2); room: those plus gamma drafts
        return start(self.net, params, pre, first_token, pre.room, 2 * pre.room)

    def propose(self, params, s: Pending, key, gamma: int, sampling: Sampling):
        """gamma tokens in gamma forwards: the pending block, then one forward per token on the
        head's own state, each seeing the prefix, the pending pairs and the earlier drafts."""
        greedy = sampling.greedy  # then the token alone: logits over a cut head's subset
        logits, g, cache = feed(self.net, params, s, subset=greedy)
        width = s.tokens.shape[1] + gamma
        toks, qs = [], []
        for i in range(gamma):
            key, sub = jax.random.split(key)
            if greedy:
                toks.append(vocab_head.argmax(self.net, params, logits))
                qs.append(jax.nn.one_hot(toks[-1], self.net.cfg.vocab_size, dtype=jnp.float32))
            else:
                toks.append(sample(sub, logits, sampling))
                qs.append(probs(logits, sampling))
            if i == gamma - 1:
                break
            at = s.cache.length + s.count + i  # slot and position of draft token i's pair
            blk = Block(
                positions=at[:, None],
                slots=at[:, None],
                block_mask=jnp.arange(width)[None, None, :] <= (s.count + i)[:, None, None],
            )
            out, g, cache = apply_head(
                self.net, params, toks[-1][:, None], g, cache, blk, subset=greedy
            )
            logits = out[:, 0]
        return jnp.stack(toks, 1), jnp.stack(qs, 1), dataclasses.replace(s, cache=cache)

    def commit(self, s: Pending, tokens, n_acc, next_token, feats=None) -> Pending:
        """The pending pairs join the cache; the target's states at the verify block
        ``feats [b, gamma + 1, d]`` pend with the accepted tokens and the next one."""
        i = jnp.arange(tokens.shape[1] + 1)[None, :]
        new = jnp.concatenate([tokens, next_token[:, None]], 1)
        new = jnp.where(i == n_acc[:, None], next_token[:, None], new)
        return pend(s, s.cache, new, feats, n_acc + 1)

    def shifted(self, s: Pending, k: int) -> Pending:
        """The cache ``k`` tokens further on (measurements time units mid-context)."""
        return dataclasses.replace(s, cache=advance(s.cache, jnp.full_like(s.count, k)))

    def keep_alive(self, s, extra):
        return s  # the proposals' K/V are in the state already


@pytree_dataclass
class FeatureTreeState:
    pending: Pending  # after a grow: the root's pair is at slot cache.length (tree node 0)
    tree: T.Tree
    state: Float[Array, "b n d"]  # each expanded node's predicted state g (its children's input)
    expanded: Bool[Array, "b n"]


@dataclasses.dataclass(frozen=True)
class FeatureTreeDraft:
    """Best-first trees from a feature head (the module docstring): ``capacity`` nodes, root
    included, grown by at most ``depth`` expansions, so a verified path has at most ``depth``
    nodes and the pending block ``depth + 1`` pairs."""

    net: Net
    reads: tuple[int, ...]
    capacity: int
    depth: int
    sparse: None = None
    reuse_target_cache: bool = False

    def init(self, params, pre, first_token) -> FeatureTreeState:
        width = self.depth + 1
        p = start(self.net, params, pre, first_token, width, width + self.capacity)
        return self._fresh(p, first_token)

    def _fresh(self, p: Pending, root_token) -> FeatureTreeState:
        b, n = root_token.shape[0], self.capacity
        state = jnp.zeros((b, n, self.net.cfg.hidden_size), p.feats.dtype)
        return FeatureTreeState(p, T.new_tree(root_token, n), state, jnp.zeros((b, n), bool))

    def grow(self, params, s: FeatureTreeState, *, expansions: int, width: int, branch: int):
        p = s.pending
        logits, g, cache = feed(self.net, params, p, subset=True)
        cache = advance(cache, p.count - 1)  # the root's pair stays at slot cache.length
        root = jnp.zeros((p.count.shape[0], 1), jnp.int32)
        tree, state, expanded = self._add(params, s.tree, s.state, s.expanded, root,
                                          logits[:, None], g, branch)  # fmt: skip
        for _ in range(expansions - 1):
            leaves = T.best_leaves(tree, width, expanded)
            # run only leaves whose children fit: a node run without adding children is wasted
            fits = (tree.capacity - tree.size) // branch
            leaves = jnp.where(jnp.arange(width)[None, :] < fits[:, None], leaves, -1)
            tokens, block = T.expand_layout(tree, leaves, cache.length, cache.length)
            parents = jnp.take_along_axis(tree.parent, jnp.maximum(leaves, 0), 1)
            inputs = jnp.take_along_axis(state, jnp.maximum(parents, 0)[..., None], 1)
            out, g, cache = apply_head(self.net, params, tokens, inputs, cache, block, subset=True)
            tree, state, expanded = self._add(params, tree, state, expanded, leaves, out, g, branch)
        return FeatureTreeState(dataclasses.replace(p, cache=cache), tree, state, expanded)

    def _add(self, params, tree: T.Tree, state, expanded, leaves, logits, g, branch: int):
        """Each run leaf's top-``branch`` children added, its predicted state kept."""
        n = tree.capacity
        child_tok, child_lp = vocab_head.top_log_probs(self.net, params, logits, branch)
        tree, new_ids = T.add_children(tree, leaves, child_tok, child_lp)
        rows = jnp.arange(leaves.shape[0])[:, None]
        dst = jnp.where(leaves >= 0, leaves, n)
        state = state.at[rows, dst].set(g.astype(state.dtype), mode="drop")
        got = jnp.any(new_ids >= 0, axis=2)
        expanded = expanded.at[rows, jnp.where(got, dst, n)].set(True, mode="drop")
        return tree, state, expanded

    def commit(self, s: FeatureTreeState, tb: T.TreeBlock, path, n_acc, bonus, feats=None):
        """The root's pair joins the cache; the target's states at the verify block's root and
        accepted slots ``feats [b, t, d]`` pend with the accepted tokens and the bonus; the
        tree restarts at the bonus."""
        m = self.depth
        path = jnp.pad(path, ((0, 0), (0, max(0, m - path.shape[1]))), constant_values=-1)[:, :m]
        slots = jnp.concatenate([jnp.zeros_like(path[:, :1]), jnp.maximum(path, 0)], 1)
        states = jnp.take_along_axis(feats, slots[..., None], 1)
        tokens = jnp.take_along_axis(tb.tokens, slots[:, 1:], 1)
        tokens = jnp.concatenate([tokens, jnp.zeros_like(bonus)[:, None]], 1)
        tokens = jnp.where(jnp.arange(m + 1)[None, :] == n_acc[:, None], bonus[:, None], tokens)
        one = jnp.ones_like(n_acc)
        p = pend(dataclasses.replace(s.pending, count=one), s.pending.cache, tokens, states,
                 n_acc + 1)  # fmt: skip
        return self._fresh(p, bonus)

    def shifted(self, s: FeatureTreeState, k: int) -> FeatureTreeState:
        cache = advance(s.pending.cache, jnp.full_like(s.pending.count, k))
        return dataclasses.replace(s, pending=dataclasses.replace(s.pending, cache=cache))

    def keep_alive(self, s, extra):
        return s  # the expansions' K/V are in the state already
