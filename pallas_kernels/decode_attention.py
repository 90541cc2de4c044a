"""Ragged batched decode / small-T attention: split-K flash-decoding over the prefix plus the
block part, merged by log-sum-exp.

Contract (the same as :func:`pallas_kernels.reference.attend`): ``q [B,T,H,hd]``, caches ``k, v
[B,S,KH,hd]`` (GQA: ``H = KH * G``), ``length [B]`` (slots ``[0, length[b])`` are the committed
prefix, seen by every query), ``block_mask [B,T,N]`` (query t sees slot ``length[b] + j`` iff
``block_mask[b, t, j]``). Output ``[B,T,H,hd]`` in ``q.dtype``; scores and softmax in float32; a
query that sees nothing returns zeros. Slots at or past ``S`` are never visible.

Kernel layout (Pallas, Triton-compatible lowering): the T queries and the G query heads that share
a KV head form ``M = T * G`` rows, padded to a power of two ``>= 16`` and cut into ``block_m`` row
tiles. The grid is ``(row tiles, KH, k_splits, B)``; program ``(i, h, j, b)`` runs an online
softmax over its prefix range ``[j * split_len, min((j + 1) * split_len, length[b]))`` in
``block_k``-slot steps (the trip count is dynamic, so slots past the row's length are never
read), and the last split also takes the block (``n_pad`` slots from ``length[b]``, in tiles of
at most ``BLOCK_TILE``, with ``block_mask``). Each program writes an unnormalised partial
``(acc, max, sumexp)``; a small jnp combine merges the splits by log-sum-exp, normalises and puts
the rows back in ``[B,T,H,hd]``.
KV loads past the range are masked (``other=0``), so junk or NaN in unused cache slots never
reaches the output.
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

from pallas_kernels.reference import attend

# Streaming-multiprocessor count of the target GPU (H100/H200: 132); only sizes k_splits.
NUM_SMS = 132
# The shortest prefix split ``plan`` makes by default, in slots. 128 on one H100 (2026-12-08,
# `bash benchmarks/gpu/decode.sh attention`, results/gpu_decode.json's attn_split rows; batch-1
# decode steps at 4K): Llama-3-8B 6.049 ms against 6.114 / 6.116 at 256 (32 splits of its 8 KV
# heads against 16) and 6.209 at 64; Llama-3.2-1B 1.305 against 1.339 / 1.335 (1.303 at 64).
# SmolLM2's fused path bounds its splits at 128 slots too (fused_linear.COMBINE_MIN_SPLIT).
MIN_SPLIT = 128
# Finite "minus infinity" for running maxima, so a fully masked tile gives exp(-inf - m) = 0
# rather than NaN.
_NEG = -1e30

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_T = 64
# Block slots: the last split takes them in tiles of at most BLOCK_TILE slots (one tile of 128
# keys is what the kernel was tuned with). A model draft's default tree has 129 nodes (1 + 4
# expansions x 8 leaves x 4 children), one past a single tile: before the tiles its expansions
# went to the flash kernel, at 22.7 us a call; in two tiles here 7.0 us (one H100, SmolLM2-shape
# draft, 1K of context; a tree round 1.59 -> 1.43 ms with the top-k below:
# benchmarks/results/spec_rounds.json).
BLOCK_TILE = 128
MAX_N = 256  # two tiles: what was measured


def reference(
    q: Float[Array, "b t h hd"],
    k: Float[Array, "b s kh hd"],
    v: Float[Array, "b s kh hd"],
    length: Int[Array, " b"],
    block_mask: Bool[Array, "b t n"],
) -> Float[Array, "b t h hd"]:
    """The pure-jnp reference (``pallas_kernels.reference.attend``)."""
    return attend(q, k, v, length, block_mask)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def tile_entries(tile) -> tuple:
    """``(block_k, num_stages, min_split, num_warps)`` of an attention tile
    (``KernelConfig.attention_tile``): None, or a shorter tuple, leaves entries None (``plan``'s
    defaults)."""
    return (tuple(tile or ()) + (None,) * 4)[:4]


def tile_problem(tile) -> str | None:
    """What is wrong with an attention tile (None: nothing)."""
    if tile is None:
        return None
    if len(tile) > 4:
        return "it is (block_k, num_stages, min_split, num_warps)"
    block_k, *counts = tile_entries(tile)
    if block_k is not None and not (
        isinstance(block_k, int) and block_k >= 16 and not block_k & (block_k - 1)
    ):
        return f"block_k must be a power of two >= 16, not {block_k!r}"
    for what, v in zip(("num_stages", "min_split", "num_warps"), counts, strict=True):
        if v is not None and not (isinstance(v, int) and v > 0):
            return f"{what} must be a positive integer, not {v!r}"
    return None


def layout_problem(q, k, v) -> str | None:
    """What no attention kernel here takes (shapes, GQA grouping, head size, dtypes), or None."""
    b, _, h, hd = q.shape
    _, s, kh, _ = k.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != hd:
        return f"shape mismatch q={q.shape} k={k.shape} v={v.shape}"
    if h % kh:
        return f"{h} query heads not a multiple of {kh} kv heads"
    if hd not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {hd} not in {SUPPORTED_HEAD_DIMS}"
    if s < 1:
        return "empty cache"
    dts = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dts) != 1 or next(iter(dts)) not in SUPPORTED_DTYPES:
        return f"dtypes {sorted(str(d) for d in dts)} (need one of bf16/f16/f32 for q, k, v)"
    return None


def block_width(n: int) -> int:
    """Block slots as the kernel lays them out: a power of two >= 16 up to ``BLOCK_TILE``, whole
    tiles past it."""
    if n <= BLOCK_TILE:
        return max(16, _next_pow2(n)) if n else 16
    return math.ceil(n / BLOCK_TILE) * BLOCK_TILE


def unsupported_reason(q, k, v, block_mask) -> str | None:
    """Why the Pallas kernel cannot take these shapes/dtypes (``None`` when it can)."""
    t = q.shape[1]
    if t > MAX_T or t < 1:
        return f"T={t} not in [1, {MAX_T}]"
    if block_mask.shape[-1] > MAX_N:
        return f"block size N={block_mask.shape[-1]} > {MAX_N}"
    return layout_problem(q, k, v)


def _dot(a, b, *, contract_b: int):
    """``a @ b`` (``contract_b=0``) or ``a @ b.T`` (``contract_b=1``) with a float32 result; float32
    inputs use full precision (IEEE on GPU, not TF32)."""
    return lax.dot_general(
        a,
        b,
        (((1,), (contract_b,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def online_update(q, carry, k, v, allowed, *, scale: float):
    """One KV tile of the online softmax: fold ``k, v [block_k, hd]`` (where ``allowed
    [rows, block_k]``) into the running ``(acc, max, sumexp)`` of the query rows ``q``."""
    acc, m, ssum = carry
    s = _dot(q, k, contract_b=1) * scale
    s = jnp.where(allowed, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    ssum = ssum * alpha + jnp.sum(p, axis=1)
    pv = _dot(p.astype(v.dtype), v, contract_b=0)
    return acc * alpha[:, None] + pv, m_new, ssum


def _kernel(
    len_ref,
    q_ref,
    k_ref,
    v_ref,
    bm_ref,
    o_ref,
    m_ref,
    ssum_ref,
    *,
    scale: float,
    seq_len: int,
    split_len: int,
    n_splits: int,
    block_k: int,
    block_m: int,
    n_rows: int,
    n_block: int,
    n_pad: int,
):
    row_tile = pl.program_id(0)
    split = pl.program_id(2)
    length = jnp.maximum(len_ref[()], 0)
    prefix = jnp.minimum(length, seq_len)
    q = q_ref[...]  # [block_m, hd]
    hd = q.shape[-1]
    update = functools.partial(online_update, q, scale=scale)

    start = split * split_len
    end = jnp.minimum(start + split_len, prefix)
    n_iter = jnp.maximum(end - start + (block_k - 1), 0) // block_k

    def body(i, carry):
        s0 = start + i * block_k
        valid = (s0 + jnp.arange(block_k)) < end
        k = plgpu.load(k_ref.at[pl.ds(s0, block_k), :], mask=valid[:, None], other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(s0, block_k), :], mask=valid[:, None], other=0.0)
        return update(carry, k, v, valid[None, :])

    carry = (
        jnp.zeros((block_m, hd), jnp.float32),
        jnp.full((block_m,), _NEG, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
    )
    carry = lax.fori_loop(0, n_iter, body, carry)

    if n_block:

        def block_part(carry):
            tile = min(n_pad, BLOCK_TILE)
            for c0 in range(0, n_pad, tile):  # static: MAX_N // BLOCK_TILE tiles at most
                cols = c0 + jnp.arange(tile)
                valid = (cols < n_block) & (length + cols < seq_len)
                at = pl.ds(length + c0, tile)
                k = plgpu.load(k_ref.at[at, :], mask=valid[:, None], other=0.0)
                v = plgpu.load(v_ref.at[at, :], mask=valid[:, None], other=0.0)
                allowed = (bm_ref[:, pl.ds(c0, tile)] != 0) & valid[None, :]
                carry = update(carry, k, v, allowed)
            return carry

        carry = lax.cond(split == n_splits - 1, block_part, lambda c: c, carry)

    acc, m, ssum = carry
    rows = row_tile * block_m + jnp.arange(block_m)
    live = rows < n_rows
    plgpu.store(o_ref, acc, mask=live[:, None])
    plgpu.store(m_ref, m, mask=live)
    plgpu.store(ssum_ref, ssum, mask=live)


def plan(
    b: int,
    s: int,
    kh: int,
    rows: int,
    *,
    k_splits: int | None = None,
    block_k: int | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_split: int | None = None,
    max_splits: int | None = None,
    head_dim: int = 128,
) -> dict:
    """Static tiling: row padding, row tile, KV block, number and length of prefix splits, Triton
    warps and pipeline stages. Defaults were picked on an H200 (bf16): KV blocks of 8192
    elements (64 slots of Llama-3-8B's 128-wide heads, 128 of SmolLM2's 64-wide ones), 4 warps,
    2 stages for decode-sized tiles and 3 once a row tile has 64 rows or a KV block 128 slots.
    Prefix splits are no shorter than ``min_split`` slots (default ``MIN_SPLIT``), at most
    ``max_splits`` of them (None: no bound), longer splits where needed. A given ``block_k``,
    ``num_stages`` or ``min_split`` overrides its default (``KernelConfig.attention_tile``)."""
    min_split = min_split or MIN_SPLIT
    m_pad = max(16, _next_pow2(rows))
    block_m = min(m_pad, block_m or 64)
    m_tiles = m_pad // block_m
    default_k = max(16, min(128, 8192 // head_dim))
    block_k = block_k or default_k
    for name, x in (("block_k", block_k), ("block_m", block_m)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"{name}={x} must be a power of two >= 16")
    if k_splits is None:
        # Enough programs to fill the GPU a few times over, but splits no shorter than min_split
        # and no more of them than max_splits.
        want = math.ceil(4 * NUM_SMS / (b * kh * m_tiles))
        k_splits = max(1, min(want, math.ceil(s / min_split), max_splits or want))
    split_len = math.ceil(math.ceil(s / k_splits) / block_k) * block_k
    k_splits = math.ceil(s / split_len)
    return dict(
        m_pad=m_pad,
        block_m=block_m,
        m_tiles=m_tiles,
        block_k=block_k,
        split_len=split_len,
        k_splits=k_splits,
        num_warps=num_warps or 4,
        num_stages=num_stages or (3 if block_m >= 64 or block_k >= 128 else 2),
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "k_splits",
        "block_k",
        "block_m",
        "num_warps",
        "num_stages",
        "min_split",
        "interpret",
    ),
)
def decode_attention_partials(
    q: Float[Array, "b t h hd"],
    k: Float[Array, "b s kh hd"],
    v: Float[Array, "b s kh hd"],
    length: Int[Array, " b"],
    block_mask: Bool[Array, "b t n"],
    *,
    k_splits: int | None = None,
    block_k: int | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_split: int | None = None,
    interpret: bool = False,
) -> tuple[
    Float[Array, "b kh splits m hd"],
    Float[Array, "b kh splits m"],
    Float[Array, "b kh splits m"],
]:
    """The kernel's raw per-split results: unnormalised ``acc``, running max ``m`` and
    ``sumexp`` per row ``r = t * G + g`` (rows past ``T * G`` and unused splits hold whatever the
    buffer held: only ``[..., :T*G]`` is defined). long: the tiling plan, the padded layouts and
    the block specs of the call are set up in one place, next to the call they feed."""
    b, t, h, hd = q.shape
    _, s, kh, _ = k.shape
    g = h // kh
    n = block_mask.shape[-1]
    rows = t * g
    p = plan(
        b,
        s,
        kh,
        rows,
        head_dim=hd,
        k_splits=k_splits,
        block_k=block_k,
        block_m=block_m,
        num_warps=num_warps,
        num_stages=num_stages,
        min_split=min_split,
    )
    m_pad, bm, n_splits = p["m_pad"], p["block_m"], p["k_splits"]
    n_pad = block_width(n)

    # Rows r = t * G + g of KV head h: [B, KH, M_pad, hd].
    qr = q.reshape(b, t, kh, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, kh, rows, hd)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, m_pad - rows), (0, 0)))
    bmr = jnp.repeat(block_mask, g, axis=1)  # [B, rows, N]
    bmr = jnp.pad(bmr, ((0, 0), (0, m_pad - rows), (0, n_pad - n))).astype(jnp.int8)
    length = length.astype(jnp.int32)

    kernel = functools.partial(
        _kernel,
        scale=1.0 / math.sqrt(hd),
        seq_len=s,
        split_len=p["split_len"],
        n_splits=n_splits,
        block_k=p["block_k"],
        block_m=bm,
        n_rows=rows,
        n_block=n,
        n_pad=n_pad,
    )
    grid = (p["m_tiles"], kh, n_splits, b)
    kv_spec = pl.BlockSpec((None, s, None, hd), lambda i, hh, j, bb: (bb, 0, hh, 0))
    f32 = jnp.float32
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None,), lambda i, hh, j, bb: (bb,)),
            pl.BlockSpec((None, None, bm, hd), lambda i, hh, j, bb: (bb, hh, i, 0)),
            kv_spec,
            kv_spec,
            pl.BlockSpec((None, bm, n_pad), lambda i, hh, j, bb: (bb, i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, bm, hd), lambda i, hh, j, bb: (bb, hh, j, i, 0)),
            pl.BlockSpec((None, None, None, bm), lambda i, hh, j, bb: (bb, hh, j, i)),
            pl.BlockSpec((None, None, None, bm), lambda i, hh, j, bb: (bb, hh, j, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, n_splits, m_pad, hd), f32),
            jax.ShapeDtypeStruct((b, kh, n_splits, m_pad), f32),
            jax.ShapeDtypeStruct((b, kh, n_splits, m_pad), f32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=p["num_warps"], num_stages=p["num_stages"]),
        interpret=interpret,
        name="jaxspec_decode_attention",
    )(length, qr, k, v, bmr)


def combine(
    acc: Float[Array, "b kh splits m hd"],
    m: Float[Array, "b kh splits m"],
    ssum: Float[Array, "b kh splits m"],
    t: int,
    dtype,
) -> Float[Array, "b t h hd"]:
    """Merge the per-split partials by log-sum-exp and restore the ``[B,T,H,hd]`` layout."""
    b, kh, _, _, hd = acc.shape
    peak = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - peak)  # m >= _NEG is finite, so no NaN
    denom = jnp.sum(ssum * w, axis=2)
    out = jnp.sum(acc * w[..., None], axis=2)
    out = jnp.where(denom[..., None] > 0, out / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
    g = out.shape[2] // t
    out = out.reshape(b, kh, t, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, t, kh * g, hd)
    return out.astype(dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "k_splits",
        "block_k",
        "block_m",
        "num_warps",
        "num_stages",
        "min_split",
        "interpret",
    ),
)
def decode_attention(
    q: Float[Array, "b t h hd"],
    k: Float[Array, "b s kh hd"],
    v: Float[Array, "b s kh hd"],
    length: Int[Array, " b"],
    block_mask: Bool[Array, "b t n"],
    *,
    k_splits: int | None = None,
    block_k: int | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_split: int | None = None,
    interpret: bool = False,
) -> Float[Array, "b t h hd"]:
    """Pallas split-K decode attention (same contract and result as ``reference``).

    ``k_splits`` (prefix splits), ``block_k`` (KV slots per step), ``block_m`` (query rows per
    program), ``num_warps``/``num_stages`` (Triton) default to the heuristics in ``plan``.
    ``interpret=True`` runs the kernel through the Pallas interpreter (CPU tests).
    """
    reason = unsupported_reason(q, k, v, block_mask)
    if reason is not None:
        raise ValueError(f"decode_attention: {reason}")
    b, t, h, hd = q.shape
    kh = k.shape[2]
    acc, m, ssum = decode_attention_partials(
        q,
        k,
        v,
        length,
        block_mask,
        k_splits=k_splits,
        block_k=block_k,
        block_m=block_m,
        num_warps=num_warps,
        num_stages=num_stages,
        min_split=min_split,
        interpret=interpret,
    )
    rows = t * (h // kh)
    return combine(acc[..., :rows, :], m[..., :rows], ssum[..., :rows], t, q.dtype)
