"""Chain speculation: the draft proposes gamma tokens, the target verifies them in one forward
over gamma + 1 tokens, and the lossless rule (acceptance.accept_chain) keeps a prefix plus one
token from the target. The whole loop runs on device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from jaxspec.config import ModelConfig
from jaxspec.engines.base import (
    execute,
    is_eos,
    prefill,
    spec_chunk,
    speculative_stats,
    until_done,
)
from jaxspec.engines.options import positive_int, reject_unknown
from jaxspec.model.kv_cache import KVCache, causal_block, init_cache
from jaxspec.model.transformer import apply
from jaxspec.pytree import pytree_dataclass
from jaxspec.spec import drafts
from jaxspec.spec.acceptance import accept_chain, accept_chain_greedy
from jaxspec.spec.sampling import Sampling, probs, sample


@pytree_dataclass
class State:
    cache: KVCache
    token: Int[Array, " b"]  # last emitted token, not yet in the target cache
    out: Int[Array, "b m"]
    count: Int[Array, " b"]
    done: Bool[Array, " b"]
    steps: Int[Array, ""]
    emitted: Int[Array, " b"]  # tokens produced per verification, summed while the row is live
    live_steps: Int[Array, " b"]
    draft: object
    key: jax.Array


def init_state(
    tparams,
    dparams,
    ids,
    lens,
    key,
    *,
    graphdef,
    cfg: ModelConfig,
    draft,
    max_new: int,
    capacity: int,
    room: int,
    sampling: Sampling,
    eos,
) -> State:
    b = ids.shape[0]
    dtype = jax.tree.leaves(tparams)[0].dtype
    cache = init_cache(cfg, b, capacity, dtype)
    logits, cache = prefill(graphdef, tparams, cache, ids, lens, vocab=cfg.vocab_size)
    key, sub = jax.random.split(key)
    tok = sample(sub, logits, sampling)
    dstate = draft.init(dparams, drafts.Prefill(ids, lens, cache, capacity, room), tok)
    out = jnp.zeros((b, max_new), jnp.int32).at[:, 0].set(tok)
    one = jnp.ones((b,), jnp.int32)
    zero = jnp.zeros((b,), jnp.int32)
    return State(
        cache,
        tok,
        out,
        one,
        is_eos(tok, eos) | (max_new <= 1),
        jnp.zeros((), jnp.int32),
        zero,
        zero,
        dstate,
        key,
    )


def emit(s_out, count, done, new_tokens, n_new, eos):
    """Append ``n_new[b]`` tokens of ``new_tokens`` to live rows, stopping after an EOS or at
    the output's end. Returns (out, count, done, appended)."""
    b, width = new_tokens.shape
    m = s_out.shape[1]
    i = jnp.arange(width)[None, :]
    hit = is_eos(new_tokens, eos) & (i < n_new[:, None])
    first_eos = jnp.min(jnp.where(hit, i, width), axis=1)
    take = jnp.minimum(jnp.minimum(n_new, first_eos + 1), m - count)
    take = jnp.where(done, 0, take)
    dst = jnp.where(i < take[:, None], count[:, None] + i, m)
    out = s_out.at[jnp.arange(b)[:, None], dst].set(new_tokens, mode="drop")
    count = count + take
    done = done | (first_eos < take) | (count >= m)
    return out, count, done, take


def verify(tparams, cache: KVCache, token, x, q, key, *, graphdef, sampling):
    """The target over ``[token, x_1..x_gamma]`` (gamma + 1 positions), then the lossless chain
    rule: (accepted count, next token, cache with the block written, not yet committed). Greedy
    needs no ``q``: the rule is then the argmax match (``accept_chain_greedy``)."""
    b, gamma = x.shape
    block = causal_block(
        cache.length, cache.length, jnp.full((b,), gamma + 1, jnp.int32), gamma + 1
    )
    logits, cache = apply(graphdef, tparams, jnp.concatenate([token[:, None], x], 1), cache, block)
    if sampling.greedy:  # the same outcome without [B, gamma + 1, V] one-hot rows and a draw
        n_acc, nxt = accept_chain_greedy(x, jnp.argmax(logits, axis=-1))
    else:
        n_acc, nxt = accept_chain(key, x, q, probs(logits, sampling))
    return n_acc, nxt, cache


def step(tparams, dparams, s: State, *, graphdef, draft, gamma: int, sampling, eos) -> State:
    key, k_draft, k_accept = jax.random.split(s.key, 3)
    x, q, dstate = draft.propose(dparams, s.draft, k_draft, gamma, sampling)
    n_acc, nxt, cache = verify(
        tparams, s.cache, s.token, x, q, k_accept, graphdef=graphdef, sampling=sampling
    )
    new = jnp.concatenate([x, nxt[:, None]], 1)
    new = jnp.where(jnp.arange(gamma + 1)[None, :] == n_acc[:, None], nxt[:, None], new)
    live = ~s.done
    out, count, done, _ = emit(s.out, s.count, s.done, new, n_acc + 1, eos)
    cache.length = cache.length + jnp.where(live, n_acc + 1, 0)
    dstate = draft.commit(dstate, x, n_acc, nxt)
    return State(
        cache,
        nxt,
        out,
        count,
        done,
        s.steps + 1,
        s.emitted + jnp.where(live, n_acc + 1, 0),
        s.live_steps + live,
        dstate,
        key,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "cfg",
        "draft",
        "gamma",
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
    gamma,
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
        room=gamma + 2,
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
            gamma=gamma,
            sampling=sampling,
            eos=eos,
        ),
        s,
        chunk,
    )
    return s.out, s.count, s.steps, s.emitted, s.live_steps


OPTIONS = ("gamma", "budget", "sinks", "ngram")


def run(target, draft, ids, lens, *, max_new, sampling, eos, seed, prompts, **options):
    reject_unknown("chain", options, OPTIONS)
    gamma = positive_int("gamma", options.pop("gamma", 4), maximum=64)
    d, dparams = drafts.resolve(target, draft, "chain", **options)
    return run_resolved(target, d, dparams, ids, lens, gamma, max_new, sampling, eos, seed)


def run_resolved(target, d, dparams, ids, lens, gamma, max_new, sampling, eos, seed):
    """The chain loop with a resolved draft (shared with MagicDec): (out, count, stats)."""
    static = dict(
        graphdef=target.graphdef,
        cfg=target.config,
        draft=d,
        gamma=gamma,
        max_new=max_new,
        capacity=ids.shape[1] + max_new + gamma + 2,
        sampling=sampling,
        eos=eos,
        chunk=spec_chunk(ids.shape[0]),
    )
    (out, count, steps, emitted, live), wall_s, compile_s = execute(
        decode, target.params, dparams, ids, lens, jax.random.key(seed), **static
    )
    stats = {
        **speculative_stats(
            steps, emitted, live, wall_s=wall_s, compile_s=compile_s, draft_per_step=gamma
        ),
        "gamma": gamma,
    }
    return out, count, stats
