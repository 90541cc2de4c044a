"""Decode attention that also rotates the new queries and keys and writes the new K/V into the
cache.

Issue 10: in a SmolLM2 decode step, five of a layer's sixteen kernels only prepare the attention
kernel's inputs: K's RoPE, V's slot select, the two cache writes and Q's preparation
(benchmarks/notes/small_step_probe.md). This kernel takes the Q/K/V projections as they leave the
GEMM, in one array ``qkv [B, T, H + 2 KH, hd]`` (query heads, then key heads, then value heads;
before RoPE), and per program:

- gathers its query rows (the ``g`` query heads of its KV head, for every new token) straight
  from ``qkv`` and rotates them (rotate-half RoPE in float32, rounded to the input dtype, as
  ``pallas_kernels.reference.apply_rope``);
- runs the same split-K online softmax over the committed prefix ``[0, length)`` as
  ``decode_attention`` (the prefix is read from the cache, never written);
- in the last split, takes the block part from registers instead of the cache: the new keys,
  rotated here, and the new values;
- in the last split of the first row tile, stores the rotated keys and the values into the
  cache at their slots. The caches are aliased inputs/outputs, so only those rows change.

``qkv`` may also be float32 partial sums ``[P, B, T, H + 2 KH, hd]`` (the split-K projection
kernels of ``fused_linear``): each load then sums the P partials and rounds to the cache's dtype,
so the projection's split-K sum needs no kernel of its own.

So nothing sits between the projection GEMM and this kernel but the GEMM's own epilogue (on the
H200, XLA's split-K sum): the first version, which took Q rotated and transposed for the kernel
and K and V as two slices, left three such fusions per layer (session 8's probe:
benchmarks/notes/small_step_probe.md).

It serves "appended" blocks only (``jaxspec.model.kv_cache.Block.appended``): token ``i`` of row
``b`` goes to slot ``length[b] + i`` (or nowhere: a slot past the capacity), and block column ``j``
is token ``j``. That is a decode step, a chain verify and the target's tree verify; a draft's tree
expansion (whose block window holds earlier nodes) takes ``decode_attention``.

The result equals ``reference`` (RoPE, ``kv_cache.write``, ``attention.attend``); the combine of
the splits is ``decode_attention.combine``. The model takes it by default on a GPU
(``JAXSPEC_FUSED_ATTENTION=auto`` in ``jaxspec/model.py``), except in programs over sharded
weights: it has no partitioning rule.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import decode_attention as D
from pallas_kernels.reference import apply_rope, attend
from pallas_kernels.reference import scatter_rows as write


def split_heads(qkv, num_heads: int, num_kv_heads: int):
    """``qkv [B, T, H + 2 KH, hd]`` as (q, k, v)."""
    h, kh = num_heads, num_kv_heads
    return qkv[:, :, :h], qkv[:, :, h : h + kh], qkv[:, :, h + kh : h + 2 * kh]


def reference(
    qkv: Float[Array, "b t nh hd"] | Float[Array, "p b t nh hd"],
    cos: Float[Array, "b t half"],
    sin: Float[Array, "b t half"],
    k_cache: Float[Array, "b s kh hd"],
    v_cache: Float[Array, "b s kh hd"],
    length: Int[Array, " b"],
    slots: Int[Array, "b t"],
    block_mask: Bool[Array, "b t t"],
    *,
    num_heads: int,
) -> tuple[Float[Array, "b t h hd"], Float[Array, "b s kh hd"], Float[Array, "b s kh hd"]]:
    """The unfused path: rotate the new queries and keys, write K/V into their slots, attend.
    ``qkv`` may be float32 partial sums ``[P, B, T, H + 2 KH, hd]`` (``fused_linear``'s): their
    sum, rounded to the cache's dtype, is the projection."""
    qkv = settled_qkv(qkv, k_cache.dtype)
    q, k, v = split_heads(qkv, num_heads, k_cache.shape[2])
    k_cache = write(k_cache, apply_rope(k, cos, sin), slots)
    v_cache = write(v_cache, v, slots)
    return attend(apply_rope(q, cos, sin), k_cache, v_cache, length, block_mask), k_cache, v_cache


def settled_qkv(qkv, dtype):
    """``qkv``, or the rounded sum of its partials when it has a leading partial axis."""
    return jnp.sum(qkv, axis=0).astype(dtype) if qkv.ndim == 5 else qkv


def unsupported_reason(qkv, num_heads: int, k_cache, block_mask) -> str | None:
    """Why the kernel cannot take these shapes (``None`` when it can)."""
    if qkv.ndim == 5:  # partial sums: float32, rounded to the cache's dtype in the kernel
        if jnp.dtype(qkv.dtype) != jnp.dtype(jnp.float32):
            return f"qkv partials must be float32, got {qkv.dtype}"
        qkv = jax.ShapeDtypeStruct(qkv.shape[1:], k_cache.dtype)
    b, t, nh, hd = qkv.shape
    kh = k_cache.shape[2]
    if nh != num_heads + 2 * kh:
        return f"qkv has {nh} heads, not {num_heads} query + 2 x {kh} KV heads"
    if block_mask.shape[-1] != t:
        return f"not an appended block: T={t}, N={block_mask.shape[-1]}"
    if k_cache.shape[0] != b or k_cache.shape[3] != hd:
        return f"qkv {qkv.shape} does not match the cache {k_cache.shape}"
    if jnp.dtype(qkv.dtype) != jnp.dtype(k_cache.dtype):
        return f"qkv dtype {qkv.dtype} is not the cache's {k_cache.dtype}"
    q_shape = jax.ShapeDtypeStruct((b, t, num_heads, hd), qkv.dtype)
    return D.unsupported_reason(q_shape, k_cache, k_cache, block_mask)


def rotate(x1, x2, cos, sin):
    """Rotate-half RoPE of the two halves, in float32, rounded back to their dtype."""
    f1, f2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    return (f1 * cos - f2 * sin).astype(x1.dtype), (f2 * cos + f1 * sin).astype(x1.dtype)


def _kernel(
    len_ref,
    slot_ref,
    q_ref,
    kn_ref,
    vn_ref,
    cos_ref,
    sin_ref,
    k_ref,
    v_ref,
    bm_ref,
    o_ref,
    m_ref,
    ssum_ref,
    ko_ref,
    vo_ref,
    *,
    scale: float,
    seq_len: int,
    split_len: int,
    n_splits: int,
    block_k: int,
    block_m: int,
    n_rows: int,
    n_new: int,
    n_pad: int,
    half: int,
    g: int,
    parts: int,
):
    """One program: a row tile of one batch row and KV head over one prefix split. long: a
    Pallas kernel body is one program (loads, RoPE, the cache write, the split's online
    softmax, the block's own keys, the stores); cutting it up would hide the memory traffic
    it is written to control."""
    row_tile = pl.program_id(0)
    dt = ko_ref.dtype

    def new(ref, idx, mask):  # qkv[idx], or the rounded sum of its partials' [s, idx]
        if not parts:
            return plgpu.load(ref.at[idx], mask=mask, other=0.0)
        total = plgpu.load(ref.at[(jnp.int32(0), *idx)], mask=mask, other=0.0)
        for s in range(1, parts):
            total = total + plgpu.load(ref.at[(jnp.int32(s), *idx)], mask=mask, other=0.0)
        return total.astype(dt)

    split = pl.program_id(2)
    length = jnp.maximum(len_ref[()], 0)
    prefix = jnp.minimum(length, seq_len)
    # this tile's query rows: row r is token r // g, query head kv_head * g + r % g
    r = row_tile * block_m + jnp.arange(block_m)
    live = r < n_rows
    tok = jnp.where(live, r // g, 0)
    head = pl.program_id(1) * g + r % g
    lanes = live[:, None]
    # gathers with one index array per dimension, all [block_m, half]
    tok, head = (jnp.broadcast_to(x[:, None], (block_m, half)) for x in (tok, head))
    col = jnp.broadcast_to(jnp.arange(half)[None, :], (block_m, half))
    q1 = new(q_ref, (tok, head, col), lanes)
    q2 = new(q_ref, (tok, head, col + half), lanes)
    qc = plgpu.load(cos_ref.at[tok, col], mask=lanes, other=0.0)
    qs = plgpu.load(sin_ref.at[tok, col], mask=lanes, other=0.0)
    q1, q2 = rotate(q1, q2, qc, qs)  # [block_m, half]: the halves RoPE pairs

    def update(carry, k1, k2, v, allowed):
        acc, m, ssum = carry
        s = (D._dot(q1, k1, contract_b=1) + D._dot(q2, k2, contract_b=1)) * scale
        s = jnp.where(allowed, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        ssum = ssum * alpha + jnp.sum(p, axis=1)
        pv = D._dot(p.astype(v.dtype), v, contract_b=0)
        return acc * alpha[:, None] + pv, m_new, ssum

    # the block part's loads first, so their latency overlaps the prefix loop's: the new keys
    # (rotated here) and values, written into the cache by the last split of the first row
    # tile (their slots are past the prefix, which is all any program reads from the cache)
    cols = jnp.arange(n_pad)
    real = cols < n_new
    valid = real & (length + cols < seq_len)
    new_rows = real[:, None]
    kh1 = new(kn_ref, (pl.ds(0, n_pad), pl.ds(0, half)), new_rows)
    kh2 = new(kn_ref, (pl.ds(0, n_pad), pl.ds(half, half)), new_rows)
    vb = new(vn_ref, (pl.ds(0, n_pad), pl.ds(0, 2 * half)), new_rows)
    c = plgpu.load(cos_ref.at[pl.ds(0, n_pad), :], mask=new_rows, other=0.0)
    sn = plgpu.load(sin_ref.at[pl.ds(0, n_pad), :], mask=new_rows, other=0.0)
    slot = plgpu.load(slot_ref.at[pl.ds(0, n_pad)], mask=real, other=-1)
    allowed = (bm_ref[...] != 0) & valid[None, :]
    k1, k2 = rotate(kh1, kh2, c, sn)
    put = (valid & (slot == length + cols) & (row_tile == 0) & (split == n_splits - 1))[:, None]
    plgpu.store(ko_ref.at[pl.ds(length, n_pad), pl.ds(0, half)], k1, mask=put)
    plgpu.store(ko_ref.at[pl.ds(length, n_pad), pl.ds(half, half)], k2, mask=put)
    plgpu.store(vo_ref.at[pl.ds(length, n_pad), :], vb, mask=put)

    start = split * split_len
    end = jnp.minimum(start + split_len, prefix)
    n_iter = jnp.maximum(end - start + (block_k - 1), 0) // block_k

    def body(i, carry):
        s0 = start + i * block_k
        ok = (s0 + jnp.arange(block_k)) < end
        rows = ok[:, None]
        k1 = plgpu.load(k_ref.at[pl.ds(s0, block_k), pl.ds(0, half)], mask=rows, other=0.0)
        k2 = plgpu.load(k_ref.at[pl.ds(s0, block_k), pl.ds(half, half)], mask=rows, other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(s0, block_k), :], mask=rows, other=0.0)
        return update(carry, k1, k2, v, ok[None, :])

    carry = (
        jnp.zeros((block_m, 2 * half), jnp.float32),
        jnp.full((block_m,), D._NEG, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
    )
    carry = lax.fori_loop(0, n_iter, body, carry)

    last = split == n_splits - 1
    carry = lax.cond(last, lambda c: update(c, k1, k2, vb, allowed), lambda c: c, carry)
    acc, m, ssum = carry
    plgpu.store(o_ref, acc, mask=lanes)
    plgpu.store(m_ref, m, mask=live)
    plgpu.store(ssum_ref, ssum, mask=live)


class Splits(NamedTuple):
    """The kernel's per-split results (``decode_attention.decode_attention_partials``' layout:
    rows ``r = t * G + g`` of each KV head; only ``[..., :T*G]`` is defined), for a consumer that
    merges them itself (``decode_attention.combine``, or ``fused_linear.combine_project``)."""

    acc: Float[Array, "b kh splits m hd"]
    m: Float[Array, "b kh splits m"]
    ssum: Float[Array, "b kh splits m"]


@functools.partial(
    jax.jit, static_argnames=("num_heads", "interpret", "tile"), donate_argnums=(3, 4)
)
def rope_attention(
    qkv: Float[Array, "b t nh hd"] | Float[Array, "p b t nh hd"],
    cos: Float[Array, "b t half"],
    sin: Float[Array, "b t half"],
    k_cache: Float[Array, "b s kh hd"],
    v_cache: Float[Array, "b s kh hd"],
    length: Int[Array, " b"],
    slots: Int[Array, "b t"],
    block_mask: Bool[Array, "b t n"],
    *,
    num_heads: int,
    interpret: bool = False,
    tile: tuple | None = None,
) -> tuple[Float[Array, "b t h hd"], Float[Array, "b s kh hd"], Float[Array, "b s kh hd"]]:
    """``reference``'s result in one kernel plus the combine: (attention output, K cache, V
    cache). ``qkv`` holds the projections before RoPE, or their float32 partial sums
    ``[P, B, T, H + 2 KH, hd]``, summed as the kernel loads them; the caches are donated
    (updated in place)."""
    split, k_cache, v_cache = rope_attention_splits(
        qkv, cos, sin, k_cache, v_cache, length, slots, block_mask,
        num_heads=num_heads, interpret=interpret, tile=tile,
    )  # fmt: skip
    rows = qkv.shape[-3] * (num_heads // k_cache.shape[2])
    acc, m, ssum = (x[..., :rows, :] if x.ndim == 5 else x[..., :rows] for x in split)
    return D.combine(acc, m, ssum, qkv.shape[-3], k_cache.dtype), k_cache, v_cache


@functools.partial(
    jax.jit,
    static_argnames=("num_heads", "interpret", "tile", "min_split", "max_splits"),
    donate_argnums=(3, 4),
)
def rope_attention_splits(
    qkv: Float[Array, "b t nh hd"] | Float[Array, "p b t nh hd"],
    cos: Float[Array, "b t half"],
    sin: Float[Array, "b t half"],
    k_cache: Float[Array, "b s kh hd"],
    v_cache: Float[Array, "b s kh hd"],
    length: Int[Array, " b"],
    slots: Int[Array, "b t"],
    block_mask: Bool[Array, "b t n"],
    *,
    num_heads: int,
    interpret: bool = False,
    tile: tuple | None = None,
    min_split: int | None = None,
    max_splits: int | None = None,
) -> tuple[Splits, Float[Array, "b s kh hd"], Float[Array, "b s kh hd"]]:
    """``rope_attention`` without the combine: (the kernel's ``Splits``, K cache, V cache).
    ``tile``: (block_k, num_stages, min_split, num_warps) overrides of ``decode_attention.plan``'s
    defaults (None: its defaults); where the tile leaves ``min_split`` open, ``min_split`` and
    ``max_splits`` are the shortest prefix split and the most splits (``plan``'s; None: its
    defaults). long: the kernel's layout (padded row tiles, the
    block mask per query row, block specs of seven inputs and five outputs) is set up in one
    place, next to the call it feeds."""
    reason = unsupported_reason(qkv, num_heads, k_cache, block_mask)
    if reason is not None:
        raise ValueError(f"rope_attention: {reason}")
    parts = qkv.shape[0] if qkv.ndim == 5 else 0
    b, t, nh, hd = qkv.shape[-4:]
    _, s, kh, _ = k_cache.shape
    h = num_heads
    g = h // kh
    rows = t * g
    block_k, stages, tile_split, warps = D.tile_entries(tile)
    if tile_split is not None:  # the tile's split length, unbounded
        min_split, max_splits = tile_split, None
    p = D.plan(b, s, kh, rows, head_dim=hd, block_k=block_k, num_stages=stages,
               num_warps=warps, min_split=min_split, max_splits=max_splits)  # fmt: skip
    m_pad, bm, n_splits = p["m_pad"], p["block_m"], p["k_splits"]
    n_pad = max(16, D._next_pow2(t))
    bmr = jnp.repeat(block_mask, g, axis=1)
    bmr = jnp.pad(bmr, ((0, 0), (0, m_pad - rows), (0, n_pad - t))).astype(jnp.int8)
    kernel = functools.partial(
        _kernel,
        scale=1.0 / math.sqrt(hd),
        seq_len=s,
        split_len=p["split_len"],
        n_splits=n_splits,
        block_k=p["block_k"],
        block_m=bm,
        n_rows=rows,
        n_new=t,
        n_pad=n_pad,
        half=hd // 2,
        g=g,
        parts=parts,
    )
    lead = (parts,) if parts else ()  # the partials' axis rides whole in every block
    z = (0,) if parts else ()
    kv_spec = pl.BlockSpec((None, s, None, hd), lambda i, hh, j, bb: (bb, 0, hh, 0))

    def head_spec(first):  # one KV head's new rows: qkv's head ``first + kv head``
        return pl.BlockSpec(
            (*lead, None, t, None, hd), lambda i, hh, j, bb: (*z, bb, 0, first + hh, 0)
        )

    tab_spec = pl.BlockSpec((None, t, hd // 2), lambda i, hh, j, bb: (bb, 0, 0))
    f32 = jnp.float32
    acc, m, ssum, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(p["m_tiles"], kh, n_splits, b),
        in_specs=[
            pl.BlockSpec((None,), lambda i, hh, j, bb: (bb,)),
            pl.BlockSpec((None, t), lambda i, hh, j, bb: (bb, 0)),
            pl.BlockSpec(
                (*lead, None, t, nh, hd), lambda i, hh, j, bb: (*z, bb, 0, 0, 0)
            ),  # queries
            head_spec(h),  # this program's new keys
            head_spec(h + kh),  # and values
            tab_spec,
            tab_spec,
            kv_spec,
            kv_spec,
            pl.BlockSpec((None, bm, n_pad), lambda i, hh, j, bb: (bb, i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, bm, hd), lambda i, hh, j, bb: (bb, hh, j, i, 0)),
            pl.BlockSpec((None, None, None, bm), lambda i, hh, j, bb: (bb, hh, j, i)),
            pl.BlockSpec((None, None, None, bm), lambda i, hh, j, bb: (bb, hh, j, i)),
            kv_spec,
            kv_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, n_splits, m_pad, hd), f32),
            jax.ShapeDtypeStruct((b, kh, n_splits, m_pad), f32),
            jax.ShapeDtypeStruct((b, kh, n_splits, m_pad), f32),
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ],
        input_output_aliases={7: 3, 8: 4},
        compiler_params=plgpu.CompilerParams(num_warps=p["num_warps"], num_stages=p["num_stages"]),
        interpret=interpret,
        name="jaxspec_rope_attention",
    )(
        length.astype(jnp.int32),
        slots.astype(jnp.int32),
        qkv,
        qkv,
        qkv,
        cos.astype(f32),
        sin.astype(f32),
        k_cache,
        v_cache,
        bmr,
    )
    return Splits(acc, m, ssum), k_cache, v_cache
