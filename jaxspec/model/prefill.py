"""Prompt batches and the chunked prefill every engine (and every draft) runs first."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from jaxspec.kernels import KernelConfig
from jaxspec.model.kv_cache import KVCache, causal_block
from jaxspec.model.transformer import Net, apply


def fit_chunk(width: int, chunk: int) -> int:
    """The widest step of at most ``chunk`` tokens that divides ``width`` (the whole width
    when it fits in one): prompts padded for another chunk still prefill every token."""
    if width <= chunk:
        return width
    step = 16 if width % 16 == 0 else 1
    c = chunk - chunk % step
    while width % c:
        c -= step
    return c


def pad_prompts(
    prompts: Sequence[np.ndarray | Sequence[int]], kernels: KernelConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad on the host: ids ``[B, L]`` int32, lengths ``[B]``, from id arrays (copied in
    one step each) or lists. L is a multiple of 16 up to one prefill chunk
    (``kernels.prefill_tokens``), then of the chunk (few distinct shapes, so few compiles)."""
    lens = np.array([len(p) for p in prompts], np.int32)
    chunk = kernels.prefill_tokens(len(prompts))
    multiple = 16 if lens.max() <= chunk else chunk
    width = int(-(-lens.max() // multiple) * multiple)
    ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return ids, lens


def prefill(
    net: Net,
    flat,
    cache: KVCache,
    ids: Int[Array, "b l"],
    lens: Int[Array, " b"],
    features: tuple[int, ...] | None = None,
):
    """Feed each row's prompt in chunks (one compiled body, ``lax.fori_loop``); return the logits
    after each row's last prompt token and the cache with the prompt committed. The chunk is
    ``net.kernels.prefill_tokens(batch)``, cut down to divide the width (``fit_chunk``). With
    ``features`` (``transformer.apply``'s), also those hidden states at every prompt position,
    ``[b, l, f]``: ``(last, cache, feats)``.

    Positions equal slots here (a dense cache); ragged rows simply stop earlier.
    """
    b, width = ids.shape
    chunk = fit_chunk(width, net.kernels.prefill_tokens(b, net.dtype))

    def forward(cache, acc, start, valid, block):
        tok = jax.lax.dynamic_slice_in_dim(ids, start, chunk, axis=1)
        select = jnp.clip(valid - 1, 0, chunk - 1)[:, None]
        got = apply(net, flat, tok, cache, block, select, features)
        ends_here = (valid > 0) & (lens <= start + chunk)
        last = jnp.where(ends_here[:, None], got[0][:, 0], acc[0])
        if features is None:
            return got[1], (last,)
        return got[1], (last, jax.lax.dynamic_update_slice_in_dim(acc[1], got[2], start, axis=1))

    acc = (jnp.zeros((b, net.cfg.vocab_size), jnp.float32),)
    if features is not None:
        size = len(features) * net.cfg.hidden_size
        acc += (jnp.zeros((b, width, size), net.dtype),)
    cache, acc = chunked(forward, cache, lens, width, chunk, acc)
    return (acc[0], cache, *acc[1:])


def chunked(forward, cache: KVCache, lens: Int[Array, " b"], width: int, chunk: int, acc):
    """A prompt of ``width`` slots in chunks of ``chunk``, written from slot 0 (what ``cache``
    held is overwritten): ``forward(cache, acc, start, valid, block) -> (cache, acc)`` runs the
    tokens at ``[start, start + chunk)`` (``valid[b]`` of them real) as ``block``; each chunk's
    valid tokens then join the prefix. The first chunk is traced on its own, as a fresh block
    (``Block.fresh``: it may attend without the cache), the others in one ``lax.fori_loop``
    body. Returns the final ``(cache, acc)``."""

    def body(c, carry, fresh=False):
        cache, acc = carry
        start = c * chunk
        valid = jnp.clip(lens - start, 0, chunk)
        block = causal_block(cache.length, cache.length, valid, chunk, fresh=fresh)
        cache, acc = forward(cache, acc, start, valid, block)
        cache.length = cache.length + valid
        return cache, acc

    cache = dataclasses.replace(cache, length=jnp.zeros_like(cache.length))
    carry = body(0, (cache, acc), fresh=True)
    if width // chunk == 1:
        return carry
    return jax.lax.fori_loop(1, width // chunk, body, carry)
