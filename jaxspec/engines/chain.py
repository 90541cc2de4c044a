"""Chain speculation: the draft proposes gamma tokens, the target verifies them in one forward
over gamma + 1 tokens, and the lossless rule (``acceptance.accept_chain``) keeps a prefix plus
one token from the target. The whole loop runs on device.

Pieces: ``propose`` (the draft), ``verify`` (the target and the rule), ``commit`` (emit, both
caches advanced along the accepted tokens); ``step`` is the three in a row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from jaxspec.engines import base
from jaxspec.model.kv_cache import KVCache, advance, causal_block
from jaxspec.model.transformer import Net, apply
from jaxspec.pytree import pytree_dataclass
from jaxspec.spec import drafts
from jaxspec.spec.acceptance import accept_chain, accept_chain_greedy
from jaxspec.spec.sampling import probs

MAX_GAMMA = 64


@dataclasses.dataclass(frozen=True)
class Options(base.DraftOptions):
    gamma: int = 4

    def __post_init__(self):
        base.positive_int("gamma", self.gamma, maximum=MAX_GAMMA)


@dataclasses.dataclass(frozen=True)
class Program:
    net: Net
    draft: object  # a resolved chain draft (spec.drafts)
    gamma: int
    req: base.Request
    capacity: int
    chunk: int


@pytree_dataclass
class State:
    cache: KVCache
    token: Int[Array, " b"]  # last emitted token, not yet in the target cache
    out: base.Out
    draft: object
    key: jax.Array


def init(prog: Program, tflat, dflat, ids, lens, seed) -> State:
    cache, tok, out, key, *feats = base.start(
        prog.net, tflat, ids, lens, jax.random.key(seed), prog.req, prog.capacity,
        prog.draft.reads,
    )  # fmt: skip
    pre = drafts.Prefill(ids, lens, cache, prog.capacity, prog.gamma + 2, *feats)
    return State(cache, tok, out, prog.draft.init(dflat, pre, tok), key)


def propose(prog: Program, dflat, s: State, key):
    """The draft's gamma tokens ``x [b, gamma]``, the distributions they were drawn from ``q``
    (one-hot for a greedy or deterministic draft), and its state with their K/V written."""
    return prog.draft.propose(dflat, s.draft, key, prog.gamma, prog.req.sampling)


def verify(prog: Program, tflat, cache: KVCache, token, x, q, key):
    """The target over ``[token, x_1..x_gamma]`` (gamma + 1 positions), then the lossless chain
    rule: (accepted count, next token, cache with the block written, not yet committed, and the
    target's states at the block that the draft ``reads``: None if none). Greedy needs no
    ``q``: the rule is then the argmax match (``accept_chain_greedy``)."""
    b, gamma = x.shape
    block = causal_block(
        cache.length, cache.length, jnp.full((b,), gamma + 1, jnp.int32), gamma + 1
    )
    tokens = jnp.concatenate([token[:, None], x], 1)
    logits, cache, *feats = apply(prog.net, tflat, tokens, cache, block, None, prog.draft.reads)
    if prog.req.sampling.greedy:  # no [B, gamma + 1, V] one-hot rows and no draw
        n_acc, nxt = accept_chain_greedy(x, jnp.argmax(logits, axis=-1))
    else:
        n_acc, nxt = accept_chain(key, x, q, probs(logits, prog.req.sampling))
    return n_acc, nxt, cache, (feats or [None])[0]


def commit(prog: Program, s: State, x, n_acc, nxt, cache: KVCache, dstate, key, feats) -> State:
    """Emit the accepted tokens and the target's next one; the target's block joins its prefix
    up to them (it is already in place); the draft commits the same (with the target's states
    at the block, for a draft that reads them)."""
    gamma = prog.gamma
    new = jnp.concatenate([x, nxt[:, None]], 1)
    new = jnp.where(jnp.arange(gamma + 1)[None, :] == n_acc[:, None], nxt[:, None], new)
    live = ~s.out.done
    out = base.emit(s.out, new, n_acc + 1, prog.req.eos)
    cache = advance(cache, jnp.where(live, n_acc + 1, 0))
    dstate = prog.draft.commit(dstate, x, n_acc, nxt, feats)
    return State(cache, nxt, out, dstate, key)


def step(prog: Program, tflat, dflat, s: State) -> State:
    key, k_draft, k_accept = jax.random.split(s.key, 3)
    x, q, dstate = propose(prog, dflat, s, k_draft)
    n_acc, nxt, cache, feats = verify(prog, tflat, s.cache, s.token, x, q, k_accept)
    return commit(prog, s, x, n_acc, nxt, cache, dstate, key, feats)


def decode(prog: Program, tflat, dflat, ids, lens, seed) -> base.Out:
    s = init(prog, tflat, dflat, ids, lens, seed)
    return base.until_done(lambda s: step(prog, tflat, dflat, s), s, prog.chunk).out


# ---- measured units: each keeps its context fixed and its result alive in the state


def _keep(prog: Program, s: State, tokens) -> State:
    """Fold ``tokens`` into the state (the last output slot; and the draft's state, which a
    prompt lookup would otherwise see unchanged and the compiler hoist out of the timing loop)
    so the work that made them stays in the program."""
    extra = jnp.sum(tokens.reshape(tokens.shape[0], -1), axis=1).astype(jnp.int32)
    out = dataclasses.replace(s.out, tokens=s.out.tokens.at[:, -1].add(extra))
    return dataclasses.replace(s, out=out, draft=prog.draft.keep_alive(s.draft, extra))


def _propose_unit(prog, tflat, dflat, s: State, aux) -> State:
    x, q, dstate = propose(prog, dflat, s, s.key)
    return _keep(prog, dataclasses.replace(s, draft=dstate), x + jnp.sum(q, -1).astype(jnp.int32))


def _proposal(prog, tflat, dflat, s: State):
    x, q, _ = propose(prog, dflat, s, s.key)
    return x, q


def _verify_unit(prog, tflat, dflat, s: State, aux) -> State:
    x, q = aux
    n_acc, nxt, cache, _ = verify(prog, tflat, s.cache, s.token, x, q, s.key)
    cache.length = s.cache.length
    return _keep(prog, dataclasses.replace(s, cache=cache), n_acc + nxt)


class Chain(base.Engine):
    name = "chain"
    Options = Options
    init = staticmethod(init)
    step = staticmethod(step)
    decode = staticmethod(decode)

    def program(self, target, draft, options: Options, req, kernels, *, resolved=None):
        """``resolved``: an already resolved (draft, weights), as MagicDec passes."""
        d, w = resolved or drafts.resolve(
            target, draft, self.name, kernels=kernels, **options.draft_kwargs()
        )
        net = target.net(kernels)
        capacity = req.width + req.max_new + options.gamma + 2
        chunk = base.spec_chunk(net.kernels, req.batch)
        return Program(net, d, options.gamma, req, capacity, chunk), w

    def stats(self, prog, out, wall_s, compile_s) -> base.SpecStats:
        return base.loop_stats(
            base.SpecStats, out, wall_s=wall_s, compile_s=compile_s,
            draft_per_step=prog.gamma, gamma=prog.gamma,
        )  # fmt: skip

    def units(self, prog):
        kind = type(prog.draft).__name__
        return {
            "draft": base.Unit(_propose_unit, f"one propose of gamma={prog.gamma} ({kind})"),
            "verify": base.Unit(
                _verify_unit, f"one target verify of gamma + 1 = {prog.gamma + 1} tokens",
                prepare=_proposal,
            ),
        }  # fmt: skip

    def shifted(self, prog, s: State, k: int) -> State:
        cache = advance(s.cache, jnp.full_like(s.cache.length, k))
        return dataclasses.replace(s, cache=cache, draft=prog.draft.shifted(s.draft, k))


ENGINE = base.register(Chain())
