"""SnapKV prompt compression (arXiv 2404.14469) for a sparse-KV draft cache.

After the prompt is in a dense cache, an *observation window* of the last ``obs`` prompt
queries (clipped to the prompt) scores every earlier position per layer and per KV head:

    score[b, kh, p] = sum over window queries t and the query heads g of group kh of
                      softmax_p'(q[t, kh, g] . k[p', kh] / sqrt(hd))[p]

(each window query's softmax runs over all it may see causally, as in the model's attention),
pooled along positions with a 1-D max- or avg-pool (kernel 5, stride 1, ``kernel // 2``
padding, as SnapKV does). The top ``budget - window`` *candidate* positions (those before the
``window`` most recent tokens) per layer and KV head go to the fixed slots ``[0, budget -
window)``; the most recent ``window`` tokens follow in the StreamingLLM ring over
``[budget - window, budget)`` (see drafts.Streaming with ``sinks = budget - window``). Pooling
treats the candidate range as the whole sequence (positions past it are padding), which is
SnapKV's own rule when ``window == obs``. A prompt no longer than the budget keeps everything in
place (slot = position). Ties go to the lower position.

Positions and RoPE stay consistent because keys are cached *after* RoPE at their true sequence
positions: moving a key to another slot does not change it, and a draft query is rotated at its
own true position (``ModelDraftState.seen``), so every query-key product still sees the exact
relative distance. Attention only needs to know which slots are valid (``[0, length)`` plus the
block), so different KV heads keeping different positions in the same slot is fine; the ring
afterwards is the Streaming ring, whose slot of sequence index j depends on j alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxspec.model.kv_cache import KVCache, causal_block
from jaxspec.model.layers import embed_rows, rope_tables, weight_of
from jaxspec.model.transformer import Net
from pallas_kernels.reference import apply_rope


def window_block_start(lens: Int[Array, " b"], obs: int) -> Int[Array, " b"]:
    """Sequence index of each row's first observation query (obs clipped to the prompt)."""
    return lens - jnp.minimum(lens, obs)


def window_queries(
    net: Net, flat, dense: KVCache, ids: Int[Array, "b l"], lens: Int[Array, " b"], obs: int
) -> list[Float[Array, "b o h hd"]]:
    """Post-RoPE queries of the last ``min(obs, len)`` prompt tokens of each row, per layer.

    The window is re-run as one block over the dense prompt cache (prefix ``[0, start)``, causal
    inside the block), which is exactly what those tokens saw at prefill; the cache the forward
    writes is discarded, so the prompt keys stay the prefill's. Rows of the result past a row's
    window length are padding."""
    start = window_block_start(lens, obs)
    n = jnp.minimum(lens, obs)
    i = jnp.arange(obs, dtype=jnp.int32)[None, :]
    tok = jnp.take_along_axis(ids, jnp.clip(start[:, None] + i, 0, ids.shape[1] - 1), 1)
    block = causal_block(start, start, n, obs)
    module = nnx.merge(net.graphdef, net.params(flat))
    cfg = module.cfg
    x = embed_rows(weight_of(module.embed_tokens), tok)
    cos, sin = rope_tables(cfg, block.positions)
    b = ids.shape[0]
    qs = []
    for layer, kc, vc in zip(module.layers, dense.k, dense.v, strict=True):
        att = layer.self_attn
        q = att.q_proj(layer.input_layernorm(x, net.kernels), net.kernels).reshape(
            b, obs, cfg.num_heads, cfg.head_dim
        )
        qs.append(apply_rope(q, cos, sin))
        x, _, _ = layer(x, cos, sin, kc, vc, start, block, net.kernels)
    return qs


def scores(
    q: Float[Array, "b o h hd"], k: Float[Array, "b s kh hd"], lens: Int[Array, " b"]
) -> Float[Array, "b kh s"]:
    """Summed attention of the observation window over every position, per KV head (float32).

    Window query t of row b sits at sequence index ``start[b] + t`` and sees ``[0, start + t]``;
    queries past the row's window (t >= min(obs, len)) count for nothing."""
    b, o, h, hd = q.shape
    kh = k.shape[2]
    start = window_block_start(lens, o)
    qg = q.reshape(b, o, kh, h // kh, hd).astype(jnp.float32)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) / jnp.sqrt(jnp.float32(hd))
    t = jnp.arange(o)[None, :, None]
    p = jnp.arange(k.shape[1])[None, None, :]
    qpos = start[:, None, None] + t
    real = t < jnp.minimum(lens, o)[:, None, None]
    see = (p <= qpos) & real  # [b, t, s]
    logits = jnp.where(see[:, None, None], logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    w = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0))
    denom = jnp.sum(w, axis=-1, keepdims=True)
    w = w / jnp.where(denom > 0, denom, 1.0)
    return jnp.sum(w, axis=(2, 3))


def pool(
    x: Float[Array, "b kh s"], valid: Bool[Array, "b s"], kernel: int, kind: str
) -> Float[Array, "b kh s"]:
    """1-D pooling along positions (stride 1, ``kernel // 2`` padding each side), with positions
    outside ``valid`` treated as padding: -inf for max, 0 for avg (which divides by ``kernel``,
    as torch's avg_pool1d with count_include_pad)."""
    if kind not in ("max", "avg"):
        raise ValueError(f"pool must be 'max' or 'avg', got {kind!r}")
    pad = kernel // 2
    fill = -jnp.inf if kind == "max" else 0.0
    x = jnp.where(valid[:, None, :], x, fill)
    op = jax.lax.max if kind == "max" else jax.lax.add
    y = jax.lax.reduce_window(
        x,
        jnp.float32(fill),
        op,
        (1, 1, kernel),
        (1, 1, 1),
        ((0, 0), (0, 0), (pad, kernel - 1 - pad)),
    )
    return y if kind == "max" else y / kernel


def select(
    pooled: Float[Array, "b kh s"], lens: Int[Array, " b"], budget: int, window: int
) -> tuple[Int[Array, "b budget kh"], Bool[Array, " b budget"]]:
    """Source sequence index of each of the ``budget`` slots per KV head, and slot validity.

    Long rows (len > budget): slots ``[0, f)`` (``f = budget - window``) hold the top-f candidate
    positions (index < len - window) by pooled score, in increasing position order; slot
    ``d >= f`` holds the latest index j < len whose ring slot is d. Short rows keep slot = index."""
    b, kh, s = pooled.shape
    f = budget - window
    d = jnp.arange(budget)[None, :]
    last = lens[:, None] - 1
    ring = jnp.where(d < f, d, d + window * jnp.maximum((last - d) // window, 0))  # [b, budget]
    ok = ring < lens[:, None]
    src = jnp.broadcast_to(ring[:, :, None], (b, budget, kh))
    if 0 < f <= s:  # (f > s: no row is longer than the budget, nothing to choose)
        cand = jnp.arange(s)[None, None, :] < (lens - window)[:, None, None]
        masked = jnp.where(cand, pooled, -jnp.inf)
        _, top = jax.lax.top_k(masked, f)  # [b, kh, f], ties: lower index first
        top = jnp.sort(top, axis=-1).transpose(0, 2, 1)  # [b, f, kh]
        long = (lens > budget)[:, None, None]
        src = src.at[:, :f].set(jnp.where(long, top, src[:, :f]))
    return src, ok


def gather(dense: KVCache, srcs: list, ok: Bool[Array, "b n"], room: int, budget: int) -> KVCache:
    """The sparse cache: per layer and KV head, slot d holds the dense key/value at ``src``;
    ``room`` empty block slots follow the budget."""

    def take(x, src):
        kept = jnp.take_along_axis(x, src[..., None], axis=1)
        kept = jnp.where(ok[..., None, None], kept, 0)
        return jnp.pad(kept, ((0, 0), (0, room), (0, 0), (0, 0)))

    return KVCache(
        [take(x, s) for x, s in zip(dense.k, srcs, strict=True)],
        [take(x, s) for x, s in zip(dense.v, srcs, strict=True)],
        jnp.minimum(dense.length, budget).astype(jnp.int32),
    )


def snapkv_cache(
    net: Net,
    flat,
    dense: KVCache,
    ids: Int[Array, "b l"],
    lens: Int[Array, " b"],
    *,
    budget: int,
    window: int,
    obs: int,
    kernel: int,
    kind: str,
    room: int,
) -> KVCache:
    """Compress a dense prompt cache (``length == lens``) to the SnapKV budget + ``room``."""
    qs = window_queries(net, flat, dense, ids, lens, obs)
    s = dense.capacity
    cand = jnp.arange(s)[None, :] < (lens - window)[:, None]
    srcs, ok = [], None
    for q, k in zip(qs, dense.k, strict=True):
        src, ok = select(pool(scores(q, k, lens), cand, kernel, kind), lens, budget, window)
        srcs.append(src)
    return gather(dense, srcs, ok, room, budget)
