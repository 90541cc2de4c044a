"""Prompt batches and the chunked prefill every engine (and every draft) runs first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

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


def pad_prompts(prompts: list[list[int]], kernels: KernelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad on the host: ids ``[B, L]`` int32, lengths ``[B]``. L is a multiple of 16 up to
    one prefill chunk (``kernels.prefill_tokens``), then of the chunk (few distinct shapes, so
    few compiles)."""
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
) -> tuple[Float[Array, "b v"], KVCache]:
    """Feed each row's prompt in chunks (one compiled body, ``lax.fori_loop``); return the logits
    after each row's last prompt token and the cache with the prompt committed. The chunk is
    ``net.kernels.prefill_tokens(batch)``, cut down to divide the width (``fit_chunk``).

    Positions equal slots here (a dense cache); ragged rows simply stop earlier.
    """
    b, width = ids.shape
    chunk = fit_chunk(width, net.kernels.prefill_tokens(b))

    def body(c, carry):
        cache, last = carry
        start = c * chunk
        valid = jnp.clip(lens - start, 0, chunk)
        tok = jax.lax.dynamic_slice_in_dim(ids, start, chunk, axis=1)
        block = causal_block(cache.length, cache.length, valid, chunk)
        select = jnp.clip(valid - 1, 0, chunk - 1)[:, None]
        logits, cache = apply(net, flat, tok, cache, block, select)
        ends_here = (valid > 0) & (lens <= start + chunk)
        last = jnp.where(ends_here[:, None], logits[:, 0], last)
        cache.length = cache.length + valid
        return cache, last

    last0 = jnp.zeros((b, net.cfg.vocab_size), jnp.float32)
    cache, last = jax.lax.fori_loop(0, width // chunk, body, (cache, last0))
    return last, cache
