"""Draft kinds behind one pure interface, used by the chain engine (and by trees via ``logits``).

    state = draft.init(params, prefill)            # after the target's prefill
    tokens, q, state = draft.propose(params, state, key, gamma, sampling)
    state = draft.commit(state, tokens, n_accepted, next_token, feats)

``feats``: the target's states at the verify block when the draft has ``reads`` (a feature
draft, ``spec.feature_drafts``), else None.

``q[b, i]`` is the processed distribution the i-th token was drawn from (one-hot when greedy or
deterministic), which the lossless acceptance rule needs. Kinds:

* ``ModelDraft(sparse=None)``: a separate small model with its own dense cache.
* ``ModelDraft(sparse=Streaming(sinks, window))``: a model with a StreamingLLM cache. With the
  target's own weights this is ``"self-streaming"`` self-speculation. Keys are stored already
  rotated at their *true* sequence positions and queries use true positions, so attention sees
  the exact relative distances of the kept tokens; slots ``[0, sinks)`` hold the first tokens and
  ``[sinks, budget)`` are a ring over the most recent ``window`` tokens.
* ``ModelDraft(sparse=SnapKV(...))``: the same ring, but the fixed slots hold the prompt
  positions SnapKV selects (jaxspec.spec.snapkv); with the target's weights, ``"self-snapkv"``.
* ``NgramDraft(n)``: prompt lookup: the tokens that followed the latest earlier occurrence of the
  last n-gram in the sequence (no model, deterministic).
* ``feature_drafts.FeatureDraft``: an EAGLE head over the target's hidden states (a
  ``FeatureModel``, from ``jaxspec.load_draft`` of a ``--kind feature`` distill).

Each model draft keeps up to two *pending* tokens (emitted but not yet in its cache): the
target's next token, plus the last draft token when the whole block was accepted. The first
forward of ``propose`` feeds them as one ragged block, so no extra draft step is spent.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxspec.errors import DraftError, OptionError
from jaxspec.kernels import KernelConfig
from jaxspec.model import tensor_parallel, vocab_head
from jaxspec.model.feature_head import FeatureModel
from jaxspec.model.kv_cache import Block, KVCache, advance, causal_block, commit_ring, init_cache
from jaxspec.model.prefill import prefill
from jaxspec.model.transformer import Model, Net, Network, apply
from jaxspec.pytree import pytree_dataclass
from jaxspec.spec import snapkv
from jaxspec.spec.feature_drafts import FeatureDraft
from jaxspec.spec.sampling import Sampling, probs, sample


@pytree_dataclass
class Prefill:
    """What the engine hands a draft after the target's prefill."""

    ids: Int[Array, "b l"]  # padded prompts
    lens: Int[Array, " b"]
    target_cache: KVCache | None  # the target's cache with the prompt (None: on another mesh)
    capacity: int = dataclasses.field(metadata=dict(static=True))  # prompt width + new + room
    room: int = dataclasses.field(metadata=dict(static=True))  # widest block an engine uses
    features: Float[Array, "b l f"] | None = None  # the target's prompt states a draft reads


@dataclasses.dataclass(frozen=True)
class Streaming:
    """StreamingLLM budget: ``sinks`` first tokens plus the ``window`` most recent."""

    sinks: int = 4
    window: int = 252

    @property
    def budget(self) -> int:
        return self.sinks + self.window

    def ring_slot(self, j):
        """Slot of the token at sequence index j (j < budget: itself; later: the ring)."""
        return jnp.where(j < self.budget, j, self.sinks + (j - self.sinks) % self.window)


@dataclasses.dataclass(frozen=True)
class SnapKV(Streaming):
    """SnapKV budget (jaxspec.spec.snapkv): ``sinks`` slots hold the prompt positions the last
    ``obs`` prompt queries attend to most (per layer and KV head, pooled with a ``kernel``-wide
    ``pool``), then the ``window`` most recent tokens follow in the Streaming ring."""

    obs: int = 16
    kernel: int = 5
    pool: str = "max"


@pytree_dataclass
class ModelDraftState:
    cache: KVCache  # committed tokens only
    pending: Int[Array, "b 2"]
    npend: Int[Array, " b"]  # 1 or 2
    seen: Int[Array, " b"]  # tokens committed to the cache so far = position of pending[0]


@dataclasses.dataclass(frozen=True)
class ModelDraft:
    net: Net
    sparse: Streaming | None = None
    reuse_target_cache: bool = False  # self-speculation: the prompt KV is the target's
    reads = None  # the target states a draft takes (feature drafts); a model reads none

    def init(self, params, pre: Prefill, first_token: Int[Array, " b"]) -> ModelDraftState:
        b = pre.ids.shape[0]
        cache = prompt_cache(self, params, pre, room=pre.room)
        pending = jnp.stack([first_token, jnp.zeros_like(first_token)], axis=1)
        return ModelDraftState(cache, pending, jnp.ones((b,), jnp.int32), pre.lens)

    def propose(self, params, s: ModelDraftState, key, gamma: int, sampling: Sampling):
        """gamma draft tokens in gamma forwards: the pending tokens (a ragged block of 1-2),
        then one forward per draft token, each seeing the prefix and every earlier block slot."""
        width = gamma + 1  # block: up to 2 pending + gamma - 1 fed draft tokens
        block = causal_block(s.cache.length, s.seen, s.npend, 2)
        greedy = sampling.greedy  # then the token alone: logits over a cut head's subset
        logits, cache = apply(
            self.net, params, s.pending, s.cache, block, (s.npend - 1)[:, None], subset=greedy
        )
        toks, qs = [], []
        for i in range(gamma):
            key, sub = jax.random.split(key)
            if greedy:
                toks.append(vocab_head.argmax(self.net, params, logits[:, 0]))
            else:
                toks.append(sample(sub, logits[:, 0], sampling, self.net))
            qs.append(self.q(logits[:, 0], toks[-1], sampling))
            if i == gamma - 1:
                break
            off = s.npend + i  # block slot of draft token i
            blk = Block(
                positions=(s.seen + off)[:, None],
                slots=(s.cache.length + off)[:, None],
                block_mask=jnp.arange(width)[None, None, :] <= off[:, None, None],
            )
            logits, cache = apply(self.net, params, toks[-1][:, None], cache, blk, subset=greedy)
        return jnp.stack(toks, 1), jnp.stack(qs, 1), dataclasses.replace(s, cache=cache)

    def q(self, logits, tok, sampling: Sampling):
        """The distribution ``tok`` was drawn from: one-hot when greedy (no whole rows needed
        when the logits are split over devices)."""
        if sampling.greedy:
            return jax.nn.one_hot(tok, self.net.cfg.vocab_size, dtype=jnp.float32)
        return probs(tensor_parallel.gather(self.net, logits), sampling)

    def commit(self, s: ModelDraftState, tokens, n_acc, next_token, feats=None):
        gamma = tokens.shape[1]
        has_kv = jnp.minimum(n_acc, gamma - 1)  # draft tokens whose KV the draft computed
        count = s.npend + has_kv
        if self.sparse is None:
            cache = advance(s.cache, count)
        else:
            src = s.cache.length[:, None] + jnp.arange(gamma + 1)[None, :]
            cache = commit_ring(
                s.cache, src, count, s.seen, self.sparse, mode=self.net.kernels.fused_commit
            )
        full = n_acc == gamma
        last_draft = jnp.take_along_axis(tokens, (gamma - 1) * jnp.ones_like(n_acc)[:, None], 1)[
            :, 0
        ]
        pending = jnp.where(
            full[:, None],
            jnp.stack([last_draft, next_token], 1),
            jnp.stack([next_token, jnp.zeros_like(next_token)], 1),
        )
        return ModelDraftState(cache, pending, 1 + full.astype(jnp.int32), s.seen + count)

    def shifted(self, s: ModelDraftState, k: int) -> ModelDraftState:
        """A dense cache ``k`` tokens further on (measurements time units mid-context); a
        sparse cache keeps its fixed budget."""
        if self.sparse is not None:
            return s
        return dataclasses.replace(
            s, cache=advance(s.cache, jnp.full_like(s.seen, k)), seen=s.seen + k
        )

    def keep_alive(self, s, extra):
        return s  # the proposals' K/V are in the state already


def prompt_cache(draft, params, pre: Prefill, *, room: int) -> KVCache:
    """A model draft's cache holding the prompt: the target's own (self-speculation) or the
    draft's prefill, then either the StreamingLLM / SnapKV selection (with ``room`` block slots
    after the budget) or the dense cache padded to the engine's capacity."""
    if draft.reuse_target_cache:
        dense = pre.target_cache
    else:
        b, width = pre.ids.shape
        cache = init_cache(draft.net.cfg, b, width, draft.net.dtype)
        _, dense = prefill(draft.net, params, cache, pre.ids, pre.lens)
    sp = draft.sparse
    if isinstance(sp, SnapKV):
        return snapkv.snapkv_cache(
            draft.net, params, dense, pre.ids, pre.lens, budget=sp.budget, window=sp.window,
            obs=sp.obs, kernel=sp.kernel, kind=sp.pool, room=room,
        )  # fmt: skip
    if sp is not None:
        return _gather_streaming(dense, pre.lens, sp, room=room)
    return _resize(dense, pre.capacity)


def _resize(cache: KVCache, capacity: int) -> KVCache:
    pad = capacity - cache.capacity
    if pad <= 0:
        return cache
    grow = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))  # noqa: E731
    return KVCache([grow(x) for x in cache.k], [grow(x) for x in cache.v], cache.length)


def _gather_streaming(dense: KVCache, lens, sp: Streaming, room: int) -> KVCache:
    """Keep the sinks and the most recent ``window`` prompt tokens, each at its ring slot."""
    d = jnp.arange(sp.budget)[None, :]
    last = lens[:, None] - 1
    # the latest sequence index j < len whose ring slot is d
    j = jnp.where(d < sp.sinks, d, d + sp.window * jnp.maximum((last - d) // sp.window, 0))
    ok = j < lens[:, None]
    src = jnp.where(ok, j, 0)
    rows = jnp.arange(lens.shape[0])[:, None]

    def take(x):
        kept = jnp.where(ok[..., None, None], x[rows, src], 0)
        return jnp.pad(kept, ((0, 0), (0, room), (0, 0), (0, 0)))

    return KVCache(
        [take(x) for x in dense.k],
        [take(x) for x in dense.v],
        jnp.minimum(lens, sp.budget).astype(jnp.int32),
    )


@pytree_dataclass
class NgramState:
    hist: Int[Array, "b h"]
    hlen: Int[Array, " b"]


@dataclasses.dataclass(frozen=True)
class NgramDraft:
    """Prompt lookup: match the last ``n`` tokens (falling back to shorter n-grams)."""

    n: int = 3
    vocab: int = 0
    reads = None

    def init(self, params, pre: Prefill, first_token) -> NgramState:
        b, width = pre.ids.shape
        hist = jnp.zeros((b, pre.capacity), jnp.int32).at[:, :width].set(pre.ids)
        hist = hist.at[jnp.arange(b), pre.lens].set(first_token)
        return NgramState(hist, pre.lens + 1)

    def propose(self, params, s: NgramState, key, gamma: int, sampling: Sampling):
        b, h = s.hist.shape
        j = jnp.arange(h)[None, :]
        best = jnp.full((b,), -1, jnp.int32)
        for n in range(self.n, 0, -1):
            # j is a match end if hist[j-n+1..j] == the last n tokens, with j < hlen - 1
            match = (j >= n - 1) & (j < s.hlen[:, None] - 1)
            for m in range(n):
                tail = jnp.take_along_axis(s.hist, jnp.maximum(s.hlen - 1 - m, 0)[:, None], 1)
                match &= jnp.roll(s.hist, m, axis=1) == tail
            latest = jnp.max(jnp.where(match, j, -1), axis=1)
            best = jnp.where(best >= 0, best, latest)
        start = jnp.where(best >= 0, best + 1, s.hlen - 1)
        idx = jnp.minimum(start[:, None] + jnp.arange(gamma)[None, :], s.hlen[:, None] - 1)
        toks = jnp.take_along_axis(s.hist, idx, 1)
        q = jax.nn.one_hot(toks, self.vocab, dtype=jnp.float32)
        return toks, q, s

    def commit(self, s: NgramState, tokens, n_acc, next_token, feats=None) -> NgramState:
        b, gamma = tokens.shape
        i = jnp.arange(gamma + 1)[None, :]
        new = jnp.concatenate([tokens, next_token[:, None]], 1)
        new = jnp.where(i == n_acc[:, None], next_token[:, None], new)
        dst = jnp.where(i <= n_acc[:, None], s.hlen[:, None] + i, jnp.iinfo(jnp.int32).max)
        hist = s.hist.at[jnp.arange(b)[:, None], dst].set(new, mode="drop")
        return NgramState(hist, s.hlen + n_acc + 1)

    def shifted(self, s: NgramState, k: int) -> NgramState:
        return s  # a lookup costs the same at any length

    def keep_alive(self, s: NgramState, extra) -> NgramState:
        """The state made to depend on a measured step's output: the value lands in the
        history's last slot, past every row's length, so the lookup itself is unchanged."""
        return NgramState(s.hist.at[:, -1].set(extra), s.hlen)


DRAFT_KINDS = ("self-streaming", "self-snapkv", "ngram")


def resolve(
    target: Model,
    draft,
    method: str,
    *,
    kernels: KernelConfig | None = None,
    budget: int = 256,
    sinks: int = 4,
    ngram: int = 3,
    window: int | None = None,
    obs: int = 16,
    pool: str = "max",
    sparse: str | None = None,
    sharded: bool | None = None,
):
    """The user's ``draft=`` argument -> (draft object, its ``Weights`` or None), with clear
    errors. ``kernels``: the call's ``KernelConfig`` (default: the draft model's own);
    ``sharded``: the draft runs on several devices (default: as its weights lie).

    Sparse budgets: StreamingLLM keeps ``sinks`` first tokens plus a ring of ``window = budget -
    sinks`` (a given ``window`` sets ``sinks = budget - window``); SnapKV keeps ``budget - window``
    positions chosen by the last ``obs`` prompt queries plus a ring of ``window`` (default
    ``max(16, budget // 4)``). ``sparse`` ("streaming" | "snapkv") gives a draft Model such a
    cache; "self-streaming" / "self-snapkv" are the target itself with one."""
    if draft is None:
        raise DraftError(
            f"method={method!r} needs a draft: pass a jaxspec.Model with the target's vocabulary, "
            f"a feature draft (jaxspec.load_draft), or one of "
            f"{', '.join(repr(k) for k in DRAFT_KINDS)}."
        )
    if sparse not in (None, "streaming", "snapkv"):
        raise OptionError(f"sparse must be 'streaming' or 'snapkv', got {sparse!r}.")
    kernels = _draft_kernels(kernels, draft if isinstance(draft, Network) else target)
    if isinstance(draft, FeatureModel):
        check_compatible(target, draft)
        if sparse is not None:
            raise OptionError(
                f"sparse={sparse!r}: a feature draft keeps a dense cache (its one layer reads a "
                "small share of what the target reads); leave sparse unset (or 'dense')."
            )
        net = draft.net(kernels, sharded=sharded)
        return FeatureDraft(net, draft.reads), draft.weights
    if isinstance(draft, Model):
        check_compatible(target, draft)
        sp = None
        if sparse is not None:
            sp = _sparse_budget(sparse, budget, sinks, window, obs, pool)
        return ModelDraft(draft.net(kernels, sharded=sharded), sp), draft.weights
    if sparse is not None:
        raise OptionError(
            f"sparse={sparse!r} applies to a draft Model; for self-speculation pass "
            "draft='self-streaming' or draft='self-snapkv'."
        )
    if draft in ("self-streaming", "self-snapkv"):
        sp = _sparse_budget(draft[5:], budget, sinks, window, obs, pool)
        net = target.net(kernels, sharded=sharded)
        return ModelDraft(net, sp, reuse_target_cache=True), target.weights
    if draft == "ngram":
        if not isinstance(ngram, int) or isinstance(ngram, bool) or ngram < 1:
            raise OptionError(f"ngram must be a positive integer, got {ngram!r}.")
        return NgramDraft(n=ngram, vocab=target.config.vocab_size), None
    raise DraftError(
        f"unknown draft {draft!r}: pass a jaxspec.Model or one of "
        f"{', '.join(repr(k) for k in DRAFT_KINDS)}."
    )


def _draft_kernels(kernels: KernelConfig | None, model: Network) -> KernelConfig:
    """The draft's kernels: the call's (else its model's), without ``invariant``: exact numerics
    matter for the target's tokens only; a draft changes how many are accepted, never which."""
    k = kernels or model.kernels or KernelConfig()
    return dataclasses.replace(k, invariant=False) if k.invariant else k


def check_compatible(target: Model, draft: Network) -> None:
    """A draft model must share the target's vocabulary and tokenizer, a feature draft also its
    hidden size (``DraftError``)."""
    if isinstance(draft, FeatureModel) and draft.config.hidden_size != target.config.hidden_size:
        raise DraftError(
            f"the feature draft reads states of size {draft.config.hidden_size} and the target's "
            f"are {target.config.hidden_size}: it was distilled for another target."
        )
    if draft.config.vocab_size != target.config.vocab_size:
        raise DraftError(
            f"the draft's vocabulary has {draft.config.vocab_size} tokens and the target's "
            f"{target.config.vocab_size}; a draft must share the target's tokenizer."
        )
    if _tokenizers_differ(target.tokenizer, draft.tokenizer):
        raise DraftError(
            "the draft's tokenizer differs from the target's; a draft must "
            "share the target's tokenizer."
        )


def _sparse_budget(kind: str, budget, sinks, window, obs, pool) -> Streaming:
    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if not is_int(budget) or (window is not None and not is_int(window)):
        raise OptionError(f"budget and window must be integers, got {budget!r}, {window!r}.")
    if kind == "streaming":
        if window is not None:
            sinks = budget - window
        if not is_int(sinks) or not (0 <= sinks < budget) or budget - sinks < 16:
            raise OptionError(
                f"self-streaming needs 0 <= sinks < budget with a window "
                f"(budget - sinks) of at least 16; got budget={budget}, sinks={sinks}."
            )
        return Streaming(sinks=sinks, window=budget - sinks)
    window = max(16, budget // 4) if window is None else window
    if not (16 <= window <= budget):
        raise OptionError(
            f"snapkv needs a recent window of at least 16 and at most the budget; got "
            f"budget={budget}, window={window}."
        )
    if not is_int(obs) or obs < 1:
        raise OptionError(f"obs must be a positive integer, got {obs!r}.")
    if pool not in ("max", "avg"):
        raise OptionError(f"pool must be 'max' or 'avg', got {pool!r}.")
    return SnapKV(sinks=budget - window, window=window, obs=obs, pool=pool)


def _tokenizers_differ(a, b) -> bool:
    if a is None or b is None:
        return False
    probe = "def f(x):\n    return x * 2  # héllo 123"
    return len(a) != len(b) or a.encode(probe) != b.encode(probe)
