"""Flash attention for long blocks: prefill chunks (and any block too wide for the decode kernel).

Issue 10: at context 4096 the default model spent 98 ms of a 184 ms request in the prefill
(``first_token_ms_ctx4096``, git show 785ba73:benchmarks/results/small_model_defaults.json). The
prompt goes in 256-token chunks, above the decode kernel's 64-query limit, so their attention was
the jnp reference: float32 scores over the whole cache, written and read back several times per
layer.

Contract: that of :func:`pallas_kernels.reference.attend` (and ``decode_attention``): ``q
[B,T,H,hd]``, caches ``k, v [B,S,KH,hd]`` (GQA: ``H = KH * G``) holding the block's own K/V at slots
``length[b] + j``, ``length [B]``, ``block_mask [B,T,N]``. Every query sees the prefix
``[0, length[b])`` and the block slots its mask row allows; a query that sees nothing returns
zeros; slots at or past ``S`` are never visible. Scores and softmax in float32.

Kernel layout (Pallas, Triton lowering): one program per (``block_q`` query tile, query head,
row). It runs the online softmax of ``decode_attention.online_update`` over the prefix in
``block_k``-slot steps (a dynamic trip count: slots past the row's length are never read), then
over the block in ``block_k``-column tiles, each with its tile of ``block_mask``. A block tile
whose mask tile is all false is skipped before its K/V are read: for a causal prefill chunk that
is every tile above the diagonal, so the chunk costs the causal half of its square. The output
is normalised in the kernel (no split-K, so no combine). KV loads past the range are masked
(``other=0``): junk or NaN in unused cache slots never reaches the output.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import decode_attention as D

BLOCK_Q = 64
BLOCK_K = 64


def unsupported_reason(q, k, v, block_mask) -> str | None:
    """Why the kernel cannot take these shapes/dtypes (``None`` when it can)."""
    if q.shape[1] < 1:
        return "no queries"
    if block_mask.shape[:2] != q.shape[:2]:
        return f"block_mask {block_mask.shape} does not match q {q.shape}"
    return D.layout_problem(q, k, v)


def _kernel(
    len_ref,
    q_ref,
    k_ref,
    v_ref,
    bm_ref,
    o_ref,
    *,
    scale: float,
    seq_len: int,
    block_k: int,
    n_block: int,
    n_tiles: int,
):
    length = jnp.maximum(len_ref[()], 0)
    prefix = jnp.minimum(length, seq_len)
    q = q_ref[...]  # [block_q, hd]
    block_q, hd = q.shape
    update = functools.partial(D.online_update, q, scale=scale)

    def prefix_tile(i, carry):
        s0 = i * block_k
        valid = (s0 + jnp.arange(block_k)) < prefix
        k = plgpu.load(k_ref.at[pl.ds(s0, block_k), :], mask=valid[:, None], other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(s0, block_k), :], mask=valid[:, None], other=0.0)
        return update(carry, k, v, valid[None, :])

    def block_tile(j, carry):
        j0 = j * block_k
        cols = j0 + jnp.arange(block_k)
        live = (cols < n_block) & (length + cols < seq_len)
        allowed = (bm_ref[:, pl.ds(j0, block_k)] != 0) & live[None, :]

        def take(carry):
            at = pl.ds(length + j0, block_k)
            k = plgpu.load(k_ref.at[at, :], mask=live[:, None], other=0.0)
            v = plgpu.load(v_ref.at[at, :], mask=live[:, None], other=0.0)
            return update(carry, k, v, allowed)

        seen = jnp.max(allowed.astype(jnp.int32)) > 0
        return lax.cond(seen, take, lambda c: c, carry)

    carry = (
        jnp.zeros((block_q, hd), jnp.float32),
        jnp.full((block_q,), D._NEG, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    carry = lax.fori_loop(0, (prefix + block_k - 1) // block_k, prefix_tile, carry)
    acc, _, ssum = lax.fori_loop(0, n_tiles, block_tile, carry)
    seen = ssum > 0
    out = acc / jnp.where(seen, ssum, 1.0)[:, None]
    o_ref[...] = jnp.where(seen[:, None], out, 0.0).astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("block_q", "block_k", "num_warps", "num_stages", "interpret")
)
def prefill_attention(
    q: Float[Array, "b t h hd"],
    k: Float[Array, "b s kh hd"],
    v: Float[Array, "b s kh hd"],
    length: Int[Array, " b"],
    block_mask: Bool[Array, "b t n"],
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> Float[Array, "b t h hd"]:
    """Flash attention of T queries over the prefix plus their block slots (the contract and
    result of ``pallas_kernels.reference.attend``). ``block_q`` (queries per program; default 64,
    less for short blocks) and ``block_k`` (KV slots per step; default 64) are powers of two >= 16;
    ``interpret=True`` runs the Pallas interpreter (CPU tests)."""
    reason = unsupported_reason(q, k, v, block_mask)
    if reason is not None:
        raise ValueError(f"prefill_attention: {reason}")
    b, t, h, hd = q.shape
    _, s, kh, _ = k.shape
    n = block_mask.shape[-1]
    bq = block_q or min(BLOCK_Q, max(16, D._next_pow2(t)))
    bk = block_k or BLOCK_K
    for name, x in (("block_q", bq), ("block_k", bk)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"{name}={x} must be a power of two >= 16")
    t_pad = math.ceil(t / bq) * bq
    n_tiles = max(1, math.ceil(n / bk))
    if t_pad != t:
        q = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
    # int8 (Triton has no bool loads); rows padded to whole query tiles, columns to whole KV tiles
    bm = jnp.pad(block_mask, ((0, 0), (0, t_pad - t), (0, n_tiles * bk - n))).astype(jnp.int8)
    g = h // kh
    kernel = functools.partial(
        _kernel,
        scale=1.0 / math.sqrt(hd),
        seq_len=s,
        block_k=bk,
        n_block=n,
        n_tiles=n_tiles,
    )
    q_spec = pl.BlockSpec((None, bq, None, hd), lambda i, hh, bb: (bb, i, hh, 0))
    kv_spec = pl.BlockSpec((None, s, None, hd), lambda i, hh, bb: (bb, 0, hh // g, 0))
    out = pl.pallas_call(
        kernel,
        grid=(t_pad // bq, h, b),
        in_specs=[
            pl.BlockSpec((None,), lambda i, hh, bb: (bb,)),
            q_spec,
            kv_spec,
            kv_spec,
            pl.BlockSpec((None, bq, n_tiles * bk), lambda i, hh, bb: (bb, i, 0)),
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct((b, t_pad, h, hd), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxspec_prefill_attention",
    )(length.astype(jnp.int32), q, k, v, bm)
    return out[:, :t]
