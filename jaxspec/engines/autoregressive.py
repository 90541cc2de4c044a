"""Autoregressive decoding: prefill, then one token per target step, the whole loop on device.

``init_state`` and ``step`` are the pure pieces; ``decode`` is the jitted loop (a
``lax.while_loop`` that checks its stop condition every ``chunk`` steps: 8 on GPU, 1 elsewhere;
see ``common.until_done``) that ``generate`` calls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from jaxspec.config import ModelConfig
from jaxspec.engines.base import execute, is_eos, loop_chunk, prefill, until_done
from jaxspec.model.kv_cache import KVCache, causal_block, init_cache
from jaxspec.model.transformer import apply
from jaxspec.pytree import pytree_dataclass
from jaxspec.spec.sampling import Sampling, sample

# decode steps per check of the stop condition on GPU (``common.until_done``)
GPU_CHUNK = 8


@pytree_dataclass
class State:
    cache: KVCache
    token: Int[Array, " b"]  # the last emitted token, not yet in the cache
    out: Int[Array, "b m"]  # emitted tokens
    count: Int[Array, " b"]  # tokens emitted per row (stops growing after EOS)
    done: Bool[Array, " b"]
    steps: Int[Array, ""]  # target forwards after prefill
    key: jax.Array


def init_state(
    graphdef,
    params,
    ids,
    lens,
    key,
    *,
    cfg: ModelConfig,
    max_new: int,
    capacity: int,
    sampling: Sampling,
    eos: tuple[int, ...],
) -> State:
    b = ids.shape[0]
    dtype = jax.tree.leaves(params)[0].dtype
    cache = init_cache(cfg, b, capacity, dtype)
    logits, cache = prefill(graphdef, params, cache, ids, lens, vocab=cfg.vocab_size)
    key, sub = jax.random.split(key)
    tok = sample(sub, logits, sampling)
    out = jnp.zeros((b, max_new), jnp.int32).at[:, 0].set(tok)
    return State(
        cache, tok, out, jnp.ones((b,), jnp.int32), is_eos(tok, eos), jnp.zeros((), jnp.int32), key
    )


def step(graphdef, params, s: State, *, sampling: Sampling, eos: tuple[int, ...]) -> State:
    """Feed the last token, emit the next one for every row that is not done."""
    b = s.token.shape[0]
    one = jnp.ones((b,), jnp.int32)
    block = causal_block(s.cache.length, s.cache.length, one, 1)
    logits, cache = apply(graphdef, params, s.token[:, None], s.cache, block)
    cache.length = cache.length + 1
    key, sub = jax.random.split(s.key)
    tok = sample(sub, logits[:, 0], sampling)
    live = ~s.done
    rows = jnp.arange(b)
    out = s.out.at[rows, jnp.where(live, s.count, s.out.shape[1])].set(tok, mode="drop")
    count = s.count + live
    done = s.done | (live & is_eos(tok, eos)) | (count >= s.out.shape[1])
    return State(cache, tok, out, count, done, s.steps + 1, key)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "cfg", "max_new", "capacity", "sampling", "eos", "chunk")
)
def decode(params, ids, lens, key, *, graphdef, cfg, max_new, capacity, sampling, eos, chunk=1):
    s = init_state(
        graphdef,
        params,
        ids,
        lens,
        key,
        cfg=cfg,
        max_new=max_new,
        capacity=capacity,
        sampling=sampling,
        eos=eos,
    )
    s.done = s.done | (s.count >= max_new)

    s = until_done(lambda s: step(graphdef, params, s, sampling=sampling, eos=eos), s, chunk)
    return s.out, s.count, s.steps


def run(target, draft, ids, lens, *, max_new, sampling, eos, seed, prompts, **options):
    from jaxspec.engines.options import reject_unknown

    reject_unknown("autoregressive", options, ())
    if draft is not None:
        from jaxspec.errors import OptionError

        raise OptionError(
            "method='autoregressive' takes no draft; pass draft=None or pick a "
            "speculative method ('chain', 'tree', 'swiftspec', 'magicdec')."
        )
    static = dict(
        graphdef=target.graphdef,
        cfg=target.config,
        max_new=max_new,
        capacity=ids.shape[1] + max_new,
        sampling=sampling,
        eos=eos,
        chunk=loop_chunk(GPU_CHUNK),
    )
    key = jax.random.key(seed)
    (out, count, steps), wall_s, compile_s = execute(
        decode, target.params, ids, lens, key, **static
    )
    stats = {
        "wall_s": wall_s,
        "compile_s": compile_s,
        "target_steps": int(steps) + 1,
        "draft_steps": 0,
        "acceptance_length": 1.0,
    }
    return out, count, stats
