"""The Flax NNX decoder-only transformer (Llama / Mistral / Qwen2 / SmolLM2 families).

One forward serves every engine: ``(tokens, cache, block) -> (logits, cache)``, where ``block``
(see kv_cache.Block) says each token's RoPE position, the cache slot its K/V go to, and which
block slots it may attend to. Prefill, decode, chain verify, tree verify and draft-tree
expansion are all this one call with different blocks.

At run time the module is split once into ``(graphdef, params)``; ``apply`` is a pure function of
both that engines call inside their own jit (NNX traversal happens only while tracing).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxspec.config import ModelConfig, rope_inv_freq
from jaxspec.kernels import resolve
from jaxspec.model.kv_cache import Block, KVCache, causal_block, init_cache
from pallas_kernels import dispatch, fused_linear, rope_attention
from pallas_kernels.reference import apply_rope
from pallas_kernels.reference import scatter_rows as write

# 'auto': the Pallas kernel on GPU where the shapes fit, else the jnp reference. Benchmarks set
# JAXSPEC_ATTENTION=reference to measure the difference.
ATTENTION_IMPL = os.environ.get("JAXSPEC_ATTENTION", "auto")
# Matmuls with fewer rows than this get zero rows appended (0: never; unset: 8 on GPU, 0
# elsewhere). XLA picks its GEMM kernel by shape: on the H200 a 1-token decode step with 8 rows
# took 4.89 ms instead of 5.81 (Llama-3-8B shape), 1.20 instead of 1.64 (1B), 1.10 instead of
# 1.40 (SmolLM2) (benchmarks/results/gpu_decode.json). Results per row are unchanged.
_ROWS_ENV = os.environ.get("JAXSPEC_MIN_GEMM_ROWS")
MIN_GEMM_ROWS: int | None = int(_ROWS_ENV) if _ROWS_ENV else None
# Where those rows are added: 'stream' (the default: the residual stream is padded once after the
# embedding and sliced once before the final norm, so the norms feed the GEMMs directly; the zero
# rows stay zero) or 'gemm' (each matmul pads its input and slices its output: on the H200 the
# pads became four kernels of a SmolLM2 layer, carrying the norms and SiLU). Same results per
# row; with the fused attention kernel, 'stream' took the SmolLM2-shape step from 0.941 to
# 0.827 ms (benchmarks/notes/small_step_probe_s8.md).
ROW_PADDING = os.environ.get("JAXSPEC_ROW_PADDING", "stream")


# The split-K projection kernels (pallas_kernels/fused_linear.py: residual add + norm + Q/K/V,
# o_proj merging the attention's splits, residual add + norm + gate/up, SiLU*mul + down; each
# hands float32 partial sums to the next) for steps of at most fused_linear.MAX_ROWS rows. 'off'
# (the default: not measured on a GPU yet; their first version, without split-K, made the
# SmolLM2-shape step slower on the H200, 1.35 ms against 1.05: benchmarks/notes/
# small_step_probe.md); 'auto': on GPU, unless the weights are sharded over several devices
# (tensor parallel: the kernels see whole weights, so the partitioner would gather them);
# 'pallas'; 'interpret' (the Pallas interpreter: CPU tests).
FUSED_IMPL = os.environ.get("JAXSPEC_FUSED_LINEAR", "off")
# The fused RoPE + cache write + attention kernel (pallas_kernels/rope_attention.py) for appended
# blocks (decode steps, chain and tree verifies): 'auto' (the default: on GPU, unless the program
# is traced for sharded weights, as it has no partitioning rule; on the H200 it took the
# SmolLM2-shape step from 1.023 to 0.941 ms and 121 of its 491 kernels away: small_step_probe_s8),
# 'off', 'pallas', 'interpret' (CPU tests).
FUSED_ATTENTION = os.environ.get("JAXSPEC_FUSED_ATTENTION", "auto")


def fused_mode(rows, *arrays) -> str | None:
    """'pallas' / 'interpret' when the fused kernels take this layer's step, else None."""
    impl = resolve(FUSED_IMPL, "JAXSPEC_FUSED_LINEAR")
    if impl is None or fused_linear.unsupported_reason(rows, *arrays) is not None:
        return None
    return impl


def min_gemm_rows() -> int:
    """The row padding in force (read while tracing, when the backend is known)."""
    if MIN_GEMM_ROWS is not None:
        return MIN_GEMM_ROWS
    return 8 if jax.default_backend() == "gpu" else 0


def stream_rows(n: int) -> int | None:
    """The padded row count of a residual stream of ``n`` rows (None: not padded)."""
    if ROW_PADDING not in ("gemm", "stream"):
        raise ValueError(f"JAXSPEC_ROW_PADDING must be gemm or stream; got {ROW_PADDING!r}")
    want = min_gemm_rows()
    if ROW_PADDING == "gemm" or n >= want:
        return None
    return want


def tokens_of(y, b: int, t: int, *tail: int):
    """``y`` (``[b, t, f]`` or padded rows ``[R, f]``) as ``[b, t, *tail]``: the real rows."""
    return y.reshape(-1, y.shape[-1])[: b * t].reshape(b, t, *tail)


def rows_like(y, like):
    """``y [b, t, ...]`` in the layout of ``like``: ``[b, t, f]``, or ``like``'s padded rows."""
    b, t = y.shape[:2]
    if like.ndim == 3:
        return y.reshape(b, t, -1)
    return jnp.pad(y.reshape(b * t, -1), ((0, like.shape[0] - b * t), (0, 0)))


def _init(rngs: nnx.Rngs, shape, dtype, scale=0.02):
    return (scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def matmul(x, w, out_dtype=None):
    """``x @ w`` for ``x [..., din]``, ``w [din, dout]``, with ``min_gemm_rows()`` applied;
    ``out_dtype`` asks for that result type (accumulation at least as precise)."""
    mm = functools.partial(jnp.matmul, preferred_element_type=out_dtype)
    rows, want = x.size // x.shape[-1], min_gemm_rows()
    if rows >= want:
        return mm(x, w)
    flat = jnp.pad(x.reshape(rows, x.shape[-1]), ((0, want - rows), (0, 0)))
    return mm(flat, w)[:rows].reshape(*x.shape[:-1], w.shape[-1])


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_init(rngs, (din, dout), dtype))
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None

    def __call__(self, x):
        y = matmul(x, self.kernel[...])
        return y if self.bias is None else y + self.bias[...]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        # As HF: normalise in float32, cast back, then scale.
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions: Int[Array, "b t"]):
    """cos, sin ``[B, T, hd/2]`` in float32 (the same float32 arithmetic HF uses)."""
    inv = jnp.asarray(rope_inv_freq(cfg), jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv
    return jnp.cos(angles), jnp.sin(angles)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = Linear(d, cfg.num_heads * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(cfg.num_heads * hd, d, bias=False, dtype=dtype, rngs=rngs)

    def fused_attention(self, dtype, k_cache, block: Block) -> str | None:
        """'pallas' / 'interpret' when this step takes the fused RoPE + cache write + attention
        kernel, else None."""
        mode = resolve(FUSED_ATTENTION, "JAXSPEC_FUSED_ATTENTION")
        if mode is None or not block.appended:
            return None
        cfg = self.cfg
        b, t = block.positions.shape
        heads = cfg.num_heads + 2 * cfg.num_kv_heads
        qkv = jax.ShapeDtypeStruct((b, t, heads, cfg.head_dim), dtype)
        why = rope_attention.unsupported_reason(qkv, cfg.num_heads, k_cache, block.block_mask)
        return mode if why is None else None

    def __call__(self, x, cos, sin, k_cache, v_cache, length, block: Block):
        """``x``: ``[b, t, d]``, or the padded rows of a ``stream_rows`` step (the output has
        ``x``'s layout)."""
        b, t = cos.shape[:2]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.fused_attention(q.dtype, k_cache, block) is not None:
            # one array, as the projection GEMM leaves it: the fused kernel gathers its heads
            qkv = tokens_of(jnp.concatenate([q, k, v], axis=-1), b, t, -1, self.cfg.head_dim)
        else:  # kept apart: under tensor parallelism a concatenate of sharded heads reshards
            qkv = tuple(tokens_of(y, b, t, -1, self.cfg.head_dim) for y in (q, k, v))
        out, k_cache, v_cache = self.attend(qkv, cos, sin, k_cache, v_cache, length, block)
        return self.o_proj(rows_like(out, x)), k_cache, v_cache

    def attend(self, qkv, cos, sin, k_cache, v_cache, length, block: Block, splits=False):
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
            mode = self.fused_attention(dtype, k_cache, block)
            if mode is not None:
                fn = (
                    rope_attention.rope_attention_splits
                    if splits
                    else rope_attention.rope_attention
                )
                return fn(
                    qkv, cos, sin, k_cache, v_cache, length, block.slots, block.block_mask,
                    num_heads=cfg.num_heads, interpret=mode == "interpret",
                )  # fmt: skip
            q, k, v = rope_attention.split_heads(
                rope_attention.settled_qkv(qkv, k_cache.dtype), cfg.num_heads, cfg.num_kv_heads
            )
        k_cache = write(k_cache, apply_rope(k, cos, sin), block.slots)
        v_cache = write(v_cache, v, block.slots)
        q = apply_rope(q, cos, sin)
        out = dispatch.attention(q, k_cache, v_cache, length, block.block_mask, impl=ATTENTION_IMPL)
        return out, k_cache, v_cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, f, bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def fused_mode(self, x) -> str | None:
        """The split-K projection kernels' mode for this step (None: the plain path)."""
        attn, mlp = self.self_attn, self.mlp
        if FUSED_IMPL == "off" or attn.cfg.qkv_bias:
            return None
        cfg = attn.cfg
        width = cfg.num_heads * cfg.head_dim
        if fused_linear.layer_problem(cfg.hidden_size, width, cfg.intermediate_size) is not None:
            return None
        weights = (attn.q_proj.kernel[...], attn.k_proj.kernel[...], attn.v_proj.kernel[...])
        weights += (mlp.gate_proj.kernel[...], mlp.up_proj.kernel[...])
        return fused_mode(x.reshape(-1, x.shape[-1]), *weights)

    def __call__(self, x, cos, sin, k_cache, v_cache, length, block):
        h, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x), cos, sin, k_cache, v_cache, length, block
        )
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_cache, v_cache

    def fused(self, x, pending, cos, sin, k_cache, v_cache, length, block, interpret: bool):
        """The same layer through the split-K projection kernels (few rows: decode and verify
        steps). ``x [M, d]`` is the residual stream before the previous layer's down projection
        is added, ``pending`` that projection's float32 partials (None before the first layer);
        returns this layer's ``(x, pending, k_cache, v_cache)``."""
        b, t = cos.shape[:2]
        attn, mlp, cfg = self.self_attn, self.mlp, self.self_attn.cfg
        fl = functools.partial(fused_linear.norm_project, interpret=interpret)
        x, qkv = fl(
            x,
            pending,
            self.input_layernorm.weight[...],
            (attn.q_proj.kernel[...], attn.k_proj.kernel[...], attn.v_proj.kernel[...]),
            eps=self.input_layernorm.eps,
        )
        qkv = qkv.reshape(qkv.shape[0], b, t, -1, cfg.head_dim)
        out, k_cache, v_cache = attn.attend(
            qkv, cos, sin, k_cache, v_cache, length, block, splits=True
        )
        wo = attn.o_proj.kernel[...]
        if isinstance(out, rope_attention.Splits):  # o_proj merges the splits as it loads
            o = fused_linear.combine_project(*out, wo, t=t, interpret=interpret)
        else:
            o = fused_linear.project(out.reshape(b * t, -1), (wo,), interpret=interpret)
        x, gate_up = fl(
            x,
            o,
            self.post_attention_layernorm.weight[...],
            (mlp.gate_proj.kernel[...], mlp.up_proj.kernel[...]),
            eps=self.post_attention_layernorm.eps,
        )
        down = fused_linear.silu_project(gate_up, mlp.down_proj.kernel[...], interpret=interpret)
        return x, down, k_cache, v_cache


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = nnx.Param(_init(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs)
        )

    def __call__(
        self,
        tokens: Int[Array, "b t"],
        cache: KVCache,
        block: Block,
        select: Int[Array, "b l"] | None = None,
    ) -> tuple[Float[Array, "b l v"], KVCache]:
        """Logits (float32) at ``select`` positions of the block (all T if None), and the cache
        with this block's K/V written. ``cache.length`` is unchanged: the caller commits."""
        b, t = tokens.shape
        x = self.embed_tokens[...][tokens]
        mode = self.layers[0].fused_mode(x)  # the split-K projection kernels take this step
        rows = stream_rows(b * t) if mode is None else None
        if rows is not None:  # the residual stream as padded rows [rows, d]
            x = jnp.pad(x.reshape(b * t, -1), ((0, rows - b * t), (0, 0)))
        cos, sin = rope_tables(self.cfg, block.positions)
        ks, vs = [], []
        if mode is not None:  # the split-K projection kernels: rows [b * t, d] and partials
            x, pending = x.reshape(b * t, -1), None
            for layer, kc, vc in zip(self.layers, cache.k, cache.v, strict=True):
                x, pending, kc, vc = layer.fused(
                    x, pending, cos, sin, kc, vc, cache.length, block, mode == "interpret"
                )
                ks.append(kc)
                vs.append(vc)
            x = fused_linear.settle(x, pending)
        else:
            for layer, kc, vc in zip(self.layers, cache.k, cache.v, strict=True):
                x, kc, vc = layer(x, cos, sin, kc, vc, cache.length, block)
                ks.append(kc)
                vs.append(vc)
        x = tokens_of(x, b, t, -1)
        if select is not None:
            x = jnp.take_along_axis(x, select[..., None], axis=1)
        x = self.norm(x)
        head = self.embed_tokens[...].T if self.lm_head is None else self.lm_head.kernel[...]
        # float32 logits straight from the accumulator: rounding them to bf16 made exact top-2
        # ties common (greedy then depends on the kernel's tie order; seen on the H200)
        logits = matmul(x, head, jnp.float32)
        return logits, KVCache(k=ks, v=vs, length=cache.length)


def apply(graphdef, params, tokens, cache, block, select=None):
    """Pure forward: merge (trace-time only) and run. Call inside a jit."""
    return nnx.merge(graphdef, params)(tokens, cache, block, select)


@dataclasses.dataclass(eq=False)
class Model:
    """A loaded model: static config, NNX graphdef, parameter state and optional tokenizer."""

    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: object | None = None
    name: str = ""

    @property
    def dtype(self):
        return jax.tree.leaves(self.params)[0].dtype

    def logits(self, tokens) -> Float[Array, "b t v"]:
        """Full causal forward without a persistent cache: ``[B, T]`` ids -> ``[B, T, V]``."""
        from jaxspec.prompts import check_token_ids

        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.ndim == 1:
            tokens = tokens[None]
        check_token_ids(tokens, self.config)
        return _full_logits(self.graphdef, self.params, tokens)


@functools.partial(jax.jit, static_argnums=0)
def _full_logits(graphdef, params, tokens):
    return full_logits(graphdef, nnx.merge(graphdef, params).cfg, params, tokens)


def full_logits(graphdef, cfg: ModelConfig, params, tokens):
    """Full causal forward ``[B, T]`` -> float32 logits ``[B, T, V]`` with a throwaway cache (the
    same call every engine makes); a pure function to use inside a jit."""
    b, t = tokens.shape
    dtype = jax.tree.leaves(params)[0].dtype
    cache = init_cache(cfg, b, t, dtype)
    zeros = jnp.zeros((b,), jnp.int32)
    block = causal_block(zeros, zeros, jnp.full((b,), t, jnp.int32), t)
    logits, _ = apply(graphdef, params, tokens, cache, block)
    return logits


def new_model(cfg: ModelConfig, *, seed: int = 0, dtype=jnp.float32, tokenizer=None) -> Model:
    """A model with random weights (tests, benchmarks of model shapes)."""
    module = Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(module)
    return Model(cfg, graphdef, params, tokenizer, name=f"random-{cfg.family}")


def abstract_model(cfg: ModelConfig, dtype=jnp.float32):
    """(graphdef, abstract params) without allocating weights: the template for loading."""
    module = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    return nnx.split(module)


def truncate(model: Model, num_layers: int) -> Model:
    """The first ``num_layers`` decoder layers of ``model`` with its final norm and head: a
    small draft that shares the target's tokenizer and embeddings with no training (an early
    exit, as in LayerSkip). The arrays are shared with ``model``, not copied."""
    from jaxspec.errors import OptionError

    if not (1 <= num_layers <= model.config.num_layers):
        raise OptionError(
            f"num_layers must be in [1, {model.config.num_layers}], got {num_layers}."
        )
    cfg = dataclasses.replace(model.config, num_layers=num_layers)
    pure = nnx.to_pure_dict(model.params)
    pure["layers"] = {i: pure["layers"][i] for i in range(num_layers)}
    graphdef, state = abstract_model(cfg, model.dtype)
    nnx.replace_by_pure_dict(state, pure)
    return Model(cfg, graphdef, state, model.tokenizer, name=f"{model.name}[:{num_layers}]")
