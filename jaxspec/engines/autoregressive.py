"""Autoregressive decoding: prefill, then one token per target step, the whole loop on device.

``init`` and ``step`` are the pure pieces; ``decode`` is the loop (a ``lax.while_loop`` that
checks its stop condition every ``prog.chunk`` steps: ``base.AR_GPU_CHUNK`` on GPU, 1 elsewhere;
see ``base.until_done``), compiled once per program and shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from jaxspec.engines import base
from jaxspec.errors import OptionError
from jaxspec.model.kv_cache import KVCache, advance, causal_block
from jaxspec.model.transformer import Net, apply
from jaxspec.pytree import pytree_dataclass
from jaxspec.spec.sampling import sample


@dataclasses.dataclass(frozen=True)
class Options(base.EngineOptions):
    """Autoregressive decoding takes no options."""


@dataclasses.dataclass(frozen=True)
class Program:
    net: Net
    req: base.Request
    capacity: int
    chunk: int


@pytree_dataclass
class State:
    cache: KVCache
    token: Int[Array, " b"]  # the last emitted token, not yet in the cache
    out: base.Out
    key: jax.Array


def init(prog: Program, tflat, dflat, ids, lens, seed) -> State:
    cache, tok, out, key = base.start(
        prog.net, tflat, ids, lens, jax.random.key(seed), prog.req, prog.capacity
    )
    return State(cache, tok, out, key)


def step(prog: Program, tflat, dflat, s: State) -> State:
    """Feed the last token, emit the next one for every row that is not done."""
    b = s.token.shape[0]
    block = causal_block(s.cache.length, s.cache.length, jnp.ones((b,), jnp.int32), 1)
    logits, cache = apply(prog.net, tflat, s.token[:, None], s.cache, block)
    key, sub = jax.random.split(s.key)
    tok = sample(sub, logits[:, 0], prog.req.sampling, prog.net)
    out = base.emit(s.out, tok[:, None], jnp.ones((b,), jnp.int32), prog.req.eos)
    return State(advance(cache, jnp.ones((b,), jnp.int32)), tok, out, key)


def decode(prog: Program, tflat, dflat, ids, lens, seed) -> base.Out:
    s = init(prog, tflat, dflat, ids, lens, seed)
    return base.until_done(lambda s: step(prog, tflat, dflat, s), s, prog.chunk).out


def _decode_unit(prog: Program, tflat, dflat, s: State, aux) -> State:
    """One decode step at a fixed context (the cache length kept)."""
    nxt = step(prog, tflat, dflat, s)
    nxt.cache.length = s.cache.length
    return nxt


class Autoregressive(base.Engine):
    name = "autoregressive"
    Options = Options
    needs_draft = False
    init = staticmethod(init)
    step = staticmethod(step)
    decode = staticmethod(decode)

    def program(self, target, draft, options, req, kernels):
        if draft is not None:
            raise OptionError(
                "method='autoregressive' takes no draft; pass draft=None or pick a "
                "speculative method ('chain', 'tree', 'swiftspec', 'magicdec')."
            )
        net = target.net(kernels)
        chunk = net.kernels.loop_steps(base.AR_GPU_CHUNK)
        return Program(net, req, req.width + req.max_new, chunk), None

    def stats(self, prog, out, wall_s, compile_s) -> base.Stats:
        return base.loop_stats(
            base.Stats, out, wall_s=wall_s, compile_s=compile_s, draft_per_step=0
        )

    def units(self, prog):
        return {"verify": base.Unit(_decode_unit, "one target decode step")}

    def shifted(self, prog, s: State, k: int) -> State:
        return dataclasses.replace(s, cache=advance(s.cache, jnp.full_like(s.cache.length, k)))


ENGINE = base.register(Autoregressive())
