"""Self-attention: Q/K/V projections, RoPE, the cache write and attention over the cache block,
by the fused RoPE + cache write + attention kernel where it takes the step, else the dispatcher
(Pallas decode / flash kernels or the jnp reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import ModelConfig
from jaxspec.kernels import KernelConfig
from jaxspec.model import exact
from jaxspec.model.kv_cache import Block
from jaxspec.model.layers import Linear, linears, mode_of, rows_like, tokens_of
from pallas_kernels import decode_attention, dispatch, fused_linear, rope_attention
from pallas_kernels.reference import apply_rope
from pallas_kernels.reference import scatter_rows as write


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = Linear(d, cfg.num_heads * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(cfg.num_heads * hd, d, bias=False, dtype=dtype, rngs=rngs)

    def fused_attention(self, dtype, k_cache, block: Block, kernels: KernelConfig) -> str | None:
        """'pallas' / 'interpret' when this step takes the fused RoPE + cache write + attention
        kernel, else None."""
        mode = mode_of(kernels.fused_attention)
        if mode is None or not block.appended:
            return None
        cfg = self.cfg
        b, t = block.positions.shape
        heads = cfg.num_heads + 2 * cfg.num_kv_heads
        qkv = jax.ShapeDtypeStruct((b, t, heads, cfg.head_dim), dtype)
        why = rope_attention.unsupported_reason(qkv, cfg.num_heads, k_cache, block.block_mask)
        return mode if why is None else None

    def __call__(self, x, cos, sin, k_cache, v_cache, length, block: Block, kernels):
        """``x``: ``[b, t, d]``, or the padded rows of a ``stream_rows`` step (the output has
        ``x``'s layout)."""
        b, t = cos.shape[:2]
        q, k, v = linears(x, (self.q_proj, self.k_proj, self.v_proj), kernels)
        if self.fused_attention(q.dtype, k_cache, block, kernels) is not None:
            # one array, as the projection GEMM leaves it: the fused kernel gathers its heads
            qkv = tokens_of(jnp.concatenate([q, k, v], axis=-1), b, t, -1, self.cfg.head_dim)
        else:  # kept apart: under tensor parallelism a concatenate of sharded heads reshards
            qkv = tuple(tokens_of(y, b, t, -1, self.cfg.head_dim) for y in (q, k, v))
        out, k_cache, v_cache = self.attend(qkv, cos, sin, k_cache, v_cache, length, block, kernels)
        return self.o_proj(rows_like(out, x), kernels), k_cache, v_cache

    def attend(self, qkv, cos, sin, k_cache, v_cache, length, block: Block, kernels, splits=False):
        """RoPE, the cache writes and attention of the projections ``qkv [b, t, H + 2 KH, hd]``
        (or their float32 partial sums ``[P, b, t, H + 2 KH, hd]``, or the tuple ``(q, k, v)``
        for the plain path): ``(out [b, t, H, hd], k_cache, v_cache)``. With ``splits``, where
        the fused attention kernel runs, ``out`` is its unmerged ``rope_attention.Splits`` (for
        ``fused_linear.combine_project``)."""
        cfg = self.cfg
        if isinstance(qkv, tuple):
            q, k, v = qkv
        else:
            dtype = k_cache.dtype if qkv.ndim == 5 else qkv.dtype
            mode = self.fused_attention(dtype, k_cache, block, kernels)
            if mode is not None:
                fn = (
                    rope_attention.rope_attention_splits
                    if splits
                    else rope_attention.rope_attention
                )
                bound = fused_linear.COMBINE_BOUNDS if splits else {}
                return fn(
                    qkv, cos, sin, k_cache, v_cache, length, block.slots, block.block_mask,
                    num_heads=cfg.num_heads, interpret=mode == "interpret",
                    tile=kernels.attention_tile, **bound,
                )  # fmt: skip
            q, k, v = rope_attention.split_heads(
                rope_attention.settled_qkv(qkv, k_cache.dtype), cfg.num_heads, cfg.num_kv_heads
            )
        rope = exact.rope if kernels.invariant else apply_rope
        k = rope(k, cos, sin)
        k_cache = write(k_cache, k, block.slots)
        v_cache = write(v_cache, v, block.slots)
        q = rope(q, cos, sin)
        if kernels.invariant:
            return exact.attend(q, k_cache, v_cache, length, block.block_mask), k_cache, v_cache

        impl = fresh_prefill(q, block, kernels)
        if impl is None:
            out = dispatch.attention(
                q, k_cache, v_cache, length, block.block_mask, impl=kernels.attention,
                tile=kernels.attention_tile,
            )  # fmt: skip
        else:  # the prompt's first chunk: its own K/V are all its queries see
            out = causal_self_attention(q, k, v, block, impl)
        return out, k_cache, v_cache


def fresh_prefill(q, block: Block, kernels: KernelConfig) -> str | None:
    """``jax.nn.dot_product_attention``'s implementation ("cudnn" / "xla") for a prompt's first
    chunk (``Block.fresh``) too wide for the decode kernel, where ``kernels.prefill_attention``
    asks for one and takes these shapes; None: the cache path."""
    impl = kernels.prefill_attention
    if impl not in ("cudnn", "xla") or not block.fresh or q.shape[1] <= decode_attention.MAX_T:
        return None
    hd = q.shape[-1]
    if hd % 8 or hd > 128:  # cuDNN's flash attention: head sizes up to 128, in steps of 8
        return None
    if impl == "cudnn" and q.dtype not in (jnp.bfloat16, jnp.float16):
        return None  # cuDNN's flash attention is 16-bit; float32 keeps the cache path
    return impl


def causal_self_attention(q, k, v, block: Block, impl: str):
    """Attention of a fresh block over its own K/V (``q [b, t, H, hd]``, ``k, v [b, t, KH,
    hd]``): the contract of ``pallas_kernels.reference.attend`` for ``causal_block``'s block on an
    empty cache. The real tokens come first, so a real query's causal row holds real keys only
    (no padding lengths: at 4K they cost cuDNN 0.6 ms of 6.7, notes/prefill_probe.md); a padding
    query sees nothing and returns zeros."""
    real = jnp.diagonal(block.block_mask, axis1=1, axis2=2)  # [b, t]: token i is real
    out = jax.nn.dot_product_attention(
        q, k.astype(q.dtype), v.astype(q.dtype), is_causal=True, implementation=impl
    )
    return jnp.where(real[:, :, None, None], out, 0).astype(q.dtype)
