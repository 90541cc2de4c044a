"""The transformer's building blocks: projections (with the GEMM row padding, and quantized
weights), RMSNorm, the MLP, RoPE tables, and the row layouts of a padded residual stream."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxspec.config import ModelConfig, rope_inv_freq
from jaxspec.kernels import KernelConfig
from jaxspec.model import exact
from pallas_kernels import quant, quant_linear, quant_wgmma
from pallas_kernels.quant import QuantizedWeight


def tokens_of(y, b: int, t: int, *tail: int):
    """``y`` (``[b, t, f]`` or padded rows ``[R, f]``) as ``[b, t, *tail]``: the real rows."""
    return y.reshape(-1, y.shape[-1])[: b * t].reshape(b, t, *tail)


def rows_like(y, like):
    """``y [b, t, ...]`` in the layout of ``like``: ``[b, t, f]``, or ``like``'s padded rows."""
    b, t = y.shape[:2]
    if like.ndim == 3:
        return y.reshape(b, t, -1)
    return jnp.pad(y.reshape(b * t, -1), ((0, like.shape[0] - b * t), (0, 0)))


def stream_rows(n: int, kernels: KernelConfig) -> int | None:
    """The padded row count of a residual stream of ``n`` rows (None: not padded): fewer than
    ``gemm_rows`` pad to it, fewer than twice it (a 9-token verify) to twice it. On an H100 a
    SmolLM2 9-token verify step took 0.866 / 0.864 ms padded to 16 rows against 0.882 / 0.897
    unpadded, 340 kernels against 371 (benchmarks/results/verify_probe.json)."""
    want = kernels.gemm_rows
    if kernels.row_padding == "gemm" or not want or n == want or n >= 2 * want:
        return None
    return want if n < want else 2 * want


def init_param(rngs: nnx.Rngs | None, shape, dtype, scale=0.02):
    """A random parameter; without ``rngs`` only its shape and dtype (an abstract model)."""
    if rngs is None:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    return (scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def filled(shape, dtype, value: float, *, abstract: bool = False):
    """A parameter holding ``value`` everywhere; with ``abstract`` only its shape and dtype."""
    if abstract:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    return jnp.full(shape, value, dtype)


def matmul(x, w, rows: int, out_dtype=None, *, w_out_in: bool = False):
    """``x @ w`` for ``x [..., din]``, ``w [din, dout]`` (or ``x @ w.T`` for ``w [dout, din]``
    with ``w_out_in``: a tied LM head reads the embedding ``[vocab, d]`` as it is stored), inputs
    of fewer than ``rows`` rows padded to that many (``KernelConfig.gemm_rows``); ``out_dtype``
    asks for that result type (accumulation at least as precise)."""

    def mm(a):
        if w_out_in:
            # contracting the stored minor axis: ``x @ w.T`` made XLA's CPU backend copy the
            # transposed 113 MB SmolLM2 embedding at every step (LM head 43 -> 7 ms, 2 cores)
            dims = (((a.ndim - 1,), (1,)), ((), ()))
            return jax.lax.dot_general(a, w, dims, preferred_element_type=out_dtype)
        return jnp.matmul(a, w, preferred_element_type=out_dtype)

    n = x.size // x.shape[-1]
    if n >= rows:
        return mm(x)
    flat = jnp.pad(x.reshape(n, x.shape[-1]), ((0, rows - n), (0, 0)))
    dout = w.shape[0] if w_out_in else w.shape[-1]
    return mm(flat)[:n].reshape(*x.shape[:-1], dout)


def weight_of(param: nnx.Param):
    """A parameter's value: an array, or a ``QuantizedWeight`` (which ``[...]`` cannot index)."""
    return param.get_value()


def quant_mode(x, w: QuantizedWeight, kernels: KernelConfig) -> str | None:
    """'pallas' / 'interpret' when ``x @ w`` takes the dequantizing kernel, else None (XLA)."""
    mode = kernels.quant_matmul
    if mode not in ("pallas", "interpret"):
        return None
    rows = x.reshape(-1, x.shape[-1])
    return mode if quant_linear.unsupported_reason(rows, w) is None else None


def dequantized(w, dtype):
    """A dense, ``QuantizedWeight`` or ``KMajorWeight`` weight as a dense ``[din, dout]``."""
    if isinstance(w, quant_wgmma.KMajorWeight):
        return quant_wgmma.dequantize(w, dtype)
    return quant.dequantize(w, dtype) if quant.is_quantized(w) else w


def project(x, w, kernels: KernelConfig, out_dtype=None, *, w_out_in: bool = False):
    """``x @ w`` for ``x [..., din]`` and a dense ``w [din, dout]`` (``matmul``, rows padded to
    ``kernels.gemm_rows``), a ``KMajorWeight`` (Hopper's WGMMA kernel, ``quant_wgmma``, for
    steps of at most 16 rows with ``kernels.quant_matmul="pallas"``), or a ``QuantizedWeight``:
    through ``quant_linear.qmatmul`` (steps of at most 16 rows, ``kernels.quant_matmul``);
    otherwise a quantized weight is dequantized, then multiplied by XLA;
    invariant numerics take ``exact.tiled_matmul`` either way. ``w_out_in``: a dense ``w`` is
    ``[dout, din]`` (``matmul``'s). The result has ``out_dtype`` (default ``x``'s)."""
    if kernels.invariant:  # one GEMM shape, a tile at a time (model/exact.py)
        dense = dequantized(w, x.dtype)
        return exact.tiled_matmul(x, dense.T if w_out_in else dense, out_dtype)
    if isinstance(w, quant_wgmma.KMajorWeight):
        rows = x.reshape(-1, x.shape[-1])
        if kernels.quant_matmul != "pallas" or quant_wgmma.unsupported_reason(rows, w):
            return matmul(x, quant_wgmma.dequantize(w, x.dtype), kernels.gemm_rows, out_dtype)
        y = quant_wgmma.qmatmul(rows, w)
        return y.astype(out_dtype or x.dtype).reshape(*x.shape[:-1], w.shape[1])
    if not quant.is_quantized(w):
        return matmul(x, w, kernels.gemm_rows, out_dtype, w_out_in=w_out_in)
    if w_out_in:
        raise ValueError("a quantized weight is stored [din, dout]; w_out_in is for dense ones")
    mode = quant_mode(x, w, kernels)
    if mode is None:
        return matmul(x, quant.dequantize(w, x.dtype), kernels.gemm_rows, out_dtype)
    bn, bk, splits, warps, stages = kernels.quant_tile or (None,) * 5
    rows = x.reshape(-1, x.shape[-1])
    parts = quant_linear.qmatmul(
        rows, w, interpret=mode == "interpret", bn=bn, bk=bk, splits=splits, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    y = parts[0] if parts.shape[0] == 1 else jnp.sum(parts, axis=0)
    return y.astype(out_dtype or x.dtype).reshape(*x.shape[:-1], w.shape[1])


def project_many(x, ws, kernels: KernelConfig) -> list:
    """``[x @ w for w in ws]`` (``project``'s); K-major weights the WGMMA kernel takes together
    (q, k and v; gate and up) in one launch, their columns side by side, then split."""
    rows = x.reshape(-1, x.shape[-1])
    grouped = (
        len(ws) > 1
        and kernels.quant_matmul == "pallas"
        and not kernels.invariant
        and all(isinstance(w, quant_wgmma.KMajorWeight) for w in ws)
        and all(quant_wgmma.unsupported_reason(rows, w) is None for w in ws)
        and quant_wgmma.group_problem(ws) is None
    )
    if not grouped:
        return [project(x, w, kernels) for w in ws]
    y = quant_wgmma.qmatmul(rows, tuple(ws)).astype(x.dtype)
    cuts = [sum(w.shape[1] for w in ws[:i]) for i in range(1, len(ws))]
    return [part.reshape(*x.shape[:-1], -1) for part in jnp.split(y, cuts, axis=-1)]


def linears(x, layers, kernels: KernelConfig) -> list:
    """``[lin(x) for lin in layers]`` for ``Linear``s, through ``project_many``."""
    ys = project_many(x, [weight_of(lin.kernel) for lin in layers], kernels)
    return [y if lin.bias is None else y + lin.bias[...] for y, lin in zip(ys, layers, strict=True)]


def embed_rows(table, tokens: Int[Array, "*s"]) -> Float[Array, "*s d"]:
    """The embeddings of ``tokens``: rows of a dense ``[V, D]`` table, or columns of a quantized
    one (stored as the LM head it also is, ``[D, V]``), dequantized."""
    if not quant.is_quantized(table):
        return table[tokens]
    flat = tokens.reshape(-1)
    cols = QuantizedWeight(
        table.values[:, flat], table.scales[:, flat],
        None if table.mins is None else table.mins[:, flat], table.bits, table.group, table.dtype,
    )  # fmt: skip
    return quant.dequantize(cols).T.reshape(*tokens.shape, -1)


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs | None):
        self.kernel = nnx.Param(init_param(rngs, (din, dout), dtype))
        self.bias = nnx.Param(filled((dout,), dtype, 0.0, abstract=rngs is None)) if bias else None

    def __call__(self, x, kernels: KernelConfig):
        y = project(x, weight_of(self.kernel), kernels)
        return y if self.bias is None else y + self.bias[...]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, *, abstract: bool = False):
        self.weight = nnx.Param(filled((dim,), dtype, 1.0, abstract=abstract))
        self.eps = eps

    def __call__(self, x, kernels: KernelConfig):
        # As HF: normalise in float32, cast back, then scale.
        if kernels.invariant:
            return self.weight[...] * exact.exact_rms(x, self.eps).astype(x.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions: Int[Array, "b t"]):
    """cos, sin ``[B, T, hd/2]`` in float32 (the same float32 arithmetic HF uses)."""
    inv = jnp.asarray(rope_inv_freq(cfg), jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv
    return jnp.cos(angles), jnp.sin(angles)


def mode_of(setting: str) -> str | None:
    """A resolved fused-kernel setting as the kernels' mode: 'pallas' / 'interpret' / None."""
    return None if setting == "off" else setting


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, f, bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x, kernels: KernelConfig):
        gate, up = linears(x, (self.gate_proj, self.up_proj), kernels)
        return self.down_proj(jax.nn.silu(gate) * up, kernels)
