"""Pick an attention implementation by backend and shape.

``attention(q, k, v, length, block_mask, impl=...)`` has the contract of
``pallas_kernels.reference.attend``. ``impl``:

- ``"reference"``: the pure-jnp ``attend`` (any backend, any shape);
- ``"pallas"``: a Pallas kernel compiled for the GPU: the split-K decode kernel
  (``decode_attention``) for 1 <= T <= 64 queries and block size N <= 256, the flash kernel
  (``prefill_attention``: prefill chunks) for wider blocks (raises off GPU or on shapes neither
  takes);
- ``"interpret"`` (or ``"pallas_interpret"``): the same kernels through the Pallas interpreter
  (CPU tests; slow);
- ``"auto"``: ``"pallas"`` when ``jax.default_backend() == "gpu"`` and the shapes fit (head_dim in
  {64, 128}; q, k, v one of bf16/f16/f32), else ``"reference"``.

Everything is decided from static shapes and dtypes, so it works under ``jax.jit``.

Under tensor parallelism (q heads and K/V heads split over a mesh axis, as
``jaxspec.model.sharding`` lays them out) the Pallas kernel runs once per device on its local heads:
it is wrapped in ``custom_partitioning`` with a Shardy rule saying the batch and head dimensions
pass through and the rest stay whole. Without the rule the partitioner cannot see into the kernel
and gathers every device's K/V cache at every layer.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import decode_attention as D
from pallas_kernels import prefill_attention as P
from pallas_kernels.reference import attend

Impl = Literal["auto", "reference", "pallas", "interpret", "pallas_interpret"]
IMPLS = ("auto", "reference", "pallas", "interpret", "pallas_interpret")


def choose_impl(q, k, v, block_mask, impl: str = "auto") -> str:
    """The implementation ``attention`` would run for these arrays (``impl`` resolved)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "pallas_interpret":
        impl = "interpret"
    if impl in ("pallas", "interpret"):  # the kernels where they take the shapes
        fits = (
            D.unsupported_reason(q, k, v, block_mask) is None
            or P.unsupported_reason(q, k, v, block_mask) is None
        )
        return impl if fits else "reference"
    if impl != "auto":
        return impl
    if jax.default_backend() == "gpu" and (
        D.unsupported_reason(q, k, v, block_mask) is None
        or P.unsupported_reason(q, k, v, block_mask) is None
    ):
        return "pallas"
    return "reference"


def attention(
    q: Float[Array, "b t h hd"],
    k: Float[Array, "b s kh hd"],
    v: Float[Array, "b s kh hd"],
    length: Int[Array, " b"],
    block_mask: Bool[Array, "b t n"],
    *,
    impl: Impl = "auto",
    tile: tuple | None = None,
) -> Float[Array, "b t h hd"]:
    """Grouped-query attention of T queries over the cache prefix plus their allowed block slots
    (see ``pallas_kernels.reference.attend``), by the implementation ``impl`` picks. ``tile``:
    the split-K decode kernel's (block_k, num_stages, min_split, num_warps) overrides (None: its
    own)."""
    chosen = choose_impl(q, k, v, block_mask, impl)
    if chosen == "reference":
        return attend(q, k, v, length, block_mask)
    if chosen == "pallas" and jax.default_backend() != "gpu":
        raise ValueError(
            f"impl='pallas' needs a GPU backend (have {jax.default_backend()!r}); "
            "use 'pallas_interpret' or 'auto'"
        )
    tile = D.tile_entries(tile)
    return _partitioned_kernel(q, k, v, length, block_mask, chosen == "interpret", tile)


def _kernel(q, k, v, length, block_mask, interpret, tile):
    if D.unsupported_reason(q, k, v, block_mask) is None:
        block_k, stages, min_split, warps = tile
        return D.decode_attention(
            q, k, v, length, block_mask, block_k=block_k, num_stages=stages,
            min_split=min_split, num_warps=warps, interpret=interpret,
        )  # fmt: skip
    return P.prefill_attention(q, k, v, length, block_mask, interpret=interpret)


_partitioned_kernel = custom_partitioning(_kernel, static_argnums=(5, 6))


def _shardings(mesh, arg_shapes):
    """(q/out, k/v, length, mask) shardings: batch and heads as K/V are split, the rest whole."""
    spec = tuple(arg_shapes[1].sharding.spec) + (None,) * 4
    b_ax, h_ax = spec[0], spec[2]
    heads = NamedSharding(mesh, PartitionSpec(b_ax, None, h_ax, None))
    return (
        heads,
        heads,
        NamedSharding(mesh, PartitionSpec(b_ax)),
        NamedSharding(mesh, PartitionSpec(b_ax, None, None)),
    )


def _partition(interpret, tile, mesh, arg_shapes, result_shape):
    qs, kvs, ls, ms = _shardings(mesh, arg_shapes)
    kern = functools.partial(_kernel, interpret=interpret, tile=tile)
    return mesh, kern, qs, (qs, kvs, kvs, ls, ms)


def _infer(interpret, tile, mesh, arg_shapes, result_shape):
    return _shardings(mesh, arg_shapes)[0]


def _rule(interpret, tile, mesh, value_types, result_types):
    from jax.interpreters.mlir import ir

    h, kh = (
        ir.RankedTensorType(value_types[0]).shape[2],
        ir.RankedTensorType(value_types[1]).shape[2],
    )
    rule = "b t (kh g) d, b s kh d, b s kh d, b, b t n -> b t (kh g) d"
    return rule, {"g": h // kh, "need_replication_factors": ("t", "g", "d", "s", "n")}


_partitioned_kernel.def_partition(
    partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_rule
)
