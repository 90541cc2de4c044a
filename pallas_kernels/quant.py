"""Weight-only quantized matrices: the one layout every reader converts to, the pure-jnp
dequantization every kernel is checked against, and jaxspec's own symmetric quantization.

A ``QuantizedWeight`` stands for a float matrix ``w [K, N]`` of a projection ``y = x @ w`` (K the
contraction axis), cut along K into groups of ``group`` rows; each (group, column) has a scale
``s`` and, in asymmetric formats, an offset ``m``. Its codes ``q``:

- ``bits=8``: ``values`` int8 ``[K, N]``; ``w = q * s`` (GGUF Q8_0: groups of 32; ``quantize``'s
  int8: one group, i.e. a scale per output channel);
- ``bits=4``: ``values`` uint8 ``[K/2, N]``, two codes 0..15 a byte; ``w = q * s + m`` with
  ``mins`` (GGUF Q4_1; AWQ, whose ``(q - z) * s`` is ``m = -z * s``), else ``w = (q - 8) * s``
  (GGUF Q4_0; ``quantize``'s int4).

The 4-bit packing is GGUF's, group by group (llama.cpp ``ggml-common.h``: in a block of 32,
byte ``j`` of ``qs`` holds element ``j`` in its low nibble and ``j + 16`` in its high one):
packed row ``g * G/2 + j`` holds rows ``g * G + j`` (low) and ``g * G + G/2 + j`` (high). So Q4
blocks load without a shuffle, and a split of K at group boundaries (tensor parallelism) splits
the packed rows at the same place.

Arithmetic: float32, then one rounding to the compute dtype ``dtype``. With 16-bit scales,
``q * s`` is exact in float32 (an 8-bit integer times an 11-bit significand), so ``q * s + m``
rounds once, as GGUF's own dequantization does (``gguf.quants``, float32: ``x * d``,
``d * (q - 8)``, ``d * q + m``): ``dequantize`` equals it bit for bit, and AWQ's ``(q - z) * s``
too (``-z * s`` is exact in float32).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped

from pallas_kernels.pytree import build, pytree_dataclass

BITS = (4, 8)
OFFSET4 = 8  # the zero code of symmetric 4-bit weights (GGUF Q4_0's ``q - 8``)
_STATIC = dict(static=True)


@pytree_dataclass
class QuantizedWeight:
    """A quantized ``[K, N]`` matrix (see the module docstring). ``values``: int8 ``[K, N]``
    (8 bits) or uint8 ``[K/2, N]`` (4 bits); ``scales`` and ``mins``: ``[K / group, N]``
    floats (their own dtype, e.g. GGUF's float16). Static: ``bits``, ``group`` (rows of K a
    scale covers) and ``dtype``, the compute dtype the weight dequantizes to (a dtype name)."""

    values: Shaped[Array | np.ndarray, "kp n"]
    scales: Float[Array | np.ndarray, "g n"]
    mins: Float[Array | np.ndarray, "g n"] | None
    bits: int = dataclasses.field(metadata=_STATIC)
    group: int = dataclasses.field(metadata=_STATIC)
    dtype: str = dataclasses.field(metadata=_STATIC)

    def __post_init__(self):
        problem = layout_problem(self.bits, self.group, self.k, self.values, self.scales)
        if problem:
            raise ValueError(problem)

    @property
    def k(self) -> int:
        return self.values.shape[0] * (8 // self.bits)

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the matrix it stands for, ``(K, N)``."""
        return self.k, self.values.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes a full read of it costs: codes, scales and mins."""
        parts = (self.values, self.scales) + (() if self.mins is None else (self.mins,))
        return sum(int(np.prod(p.shape)) * jnp.dtype(p.dtype).itemsize for p in parts)

    def astype(self, dtype) -> QuantizedWeight:
        """The same codes and scales dequantizing to another compute dtype."""
        return dataclasses.replace(self, dtype=jnp.dtype(dtype).name)

    @classmethod
    def abstract(cls, bits, group, dtype, k, n, scales, mins=None, sharding=None):
        """A placeholder of ``jax.ShapeDtypeStruct`` leaves (a restore template): a ``[k, n]``
        matrix with ``scales`` (and ``mins``, None: none) of those dtypes, each leaf with
        ``sharding`` (a ``QuantizedWeight`` of shardings, or None)."""
        codes = (k, n) if bits == 8 else (k // 2, n)
        shapes = dict(
            values=(codes, {8: jnp.int8, 4: jnp.uint8}[bits]), scales=((k // group, n), scales)
        )
        if mins is not None:
            shapes["mins"] = ((k // group, n), mins)
        leaves = {
            name: jax.ShapeDtypeStruct(shape, dt, sharding=getattr(sharding, name, None))
            for name, (shape, dt) in shapes.items()
        }
        leaves.setdefault("mins", None)
        return build(cls, **leaves, bits=bits, group=group, dtype=jnp.dtype(dtype).name)


def group_problem(bits: int, group: int, k: int) -> str | None:
    """Why ``bits``-bit groups of ``group`` rows cannot cut K rows (None: they can)."""
    if bits not in BITS:
        return f"bits={bits}: quantized weights have 4 or 8 bits"
    if group < 1 or k % group or (bits == 4 and group % 2):
        return f"a group of {group} rows does not divide K={k} into whole (even, for 4 bits) groups"
    return None


def layout_problem(bits: int, group: int, k: int, values, scales) -> str | None:
    """What is wrong with a quantized layout (None: nothing)."""
    problem = group_problem(bits, group, k)
    if problem:
        return problem
    want = {8: jnp.int8, 4: jnp.uint8}[bits]
    if jnp.dtype(values.dtype) != jnp.dtype(want):
        return f"{bits}-bit codes are {jnp.dtype(want).name}, got {values.dtype}"
    if tuple(scales.shape) != (k // group, values.shape[1]):
        want = (k // group, values.shape[1])
        return f"scales {tuple(scales.shape)} for K={k} in groups of {group}: want {want}"
    return None


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


def low_row(p, group: int):
    """The row of K in the low nibble of packed row ``p`` (its high nibble: ``+ group // 2``)."""
    half = group // 2
    return (p // half) * group + p % half


def _xp(a):
    return jnp if isinstance(a, jax.Array) else np


def pack4(
    codes: Shaped[Array | np.ndarray, "k n"], group: int
) -> Shaped[Array | np.ndarray, "kp n"]:
    """4-bit codes ``[K, N]`` (0..15) as packed bytes ``[K/2, N]`` (numpy in, numpy out)."""
    k, n = codes.shape
    c = codes.astype(np.uint8).reshape(k // group, 2, group // 2, n)
    return (c[:, 0] | (c[:, 1] << 4)).reshape(k // 2, n)


def unpack4(
    values: Shaped[Array | np.ndarray, "kp n"], group: int
) -> Shaped[Array | np.ndarray, "k n"]:
    """Packed bytes ``[K/2, N]`` as codes ``[K, N]`` (uint8, 0..15)."""
    kp, n = values.shape
    v = values.reshape(2 * kp // group, 1, group // 2, n)
    both = _xp(values).concatenate([v & 15, v >> 4], axis=1)
    return both.reshape(2 * kp, n)


def codes(w: QuantizedWeight):
    """The codes ``[K, N]``: int8 for 8 bits, uint8 0..15 for 4 bits."""
    return w.values if w.bits == 8 else unpack4(w.values, w.group)


def dequantize(w: QuantizedWeight, dtype=None) -> Float[Array, "k n"]:
    """The float matrix ``[K, N]`` in ``dtype`` (default: ``w.dtype``), computed as the module
    docstring says."""
    q = jnp.asarray(codes(w)).astype(jnp.float32)
    s = jnp.repeat(jnp.asarray(w.scales).astype(jnp.float32), w.group, axis=0)
    if w.mins is not None:
        f = q * s + jnp.repeat(jnp.asarray(w.mins).astype(jnp.float32), w.group, axis=0)
    else:
        f = (q - OFFSET4) * s if w.bits == 4 else q * s
    return f.astype(dtype or w.dtype)


def quantize(
    w: Float[Array, "k n"], bits: int, group: int | None = None, *, scale_dtype=jnp.float32
) -> QuantizedWeight:
    """Symmetric quantization of ``w [K, N]``: a scale per ``group`` rows of each column (None:
    one group, per output channel), codes ``round(w / s)`` with ``s = max|w| / 127`` (8 bits) or
    ``max|w| / 7`` (4 bits, stored as ``q + 8``). The compute dtype is ``w``'s."""
    k, n = w.shape
    group = group or k
    problem = group_problem(bits, group, k)
    if problem:
        raise ValueError(problem)
    top = 127 if bits == 8 else 7
    wf = jnp.asarray(w, jnp.float32).reshape(k // group, group, n)
    s = (jnp.max(jnp.abs(wf), axis=1) / top).astype(scale_dtype)
    sf = s.astype(jnp.float32)[:, None, :]
    q = jnp.round(wf / jnp.where(sf > 0, sf, 1.0)).clip(-top, top).reshape(k, n)
    if bits == 8:
        values = q.astype(jnp.int8)
    else:
        values = pack4((q + OFFSET4).astype(jnp.uint8), group)
    return QuantizedWeight(values, s, None, bits, group, jnp.dtype(w.dtype).name)
