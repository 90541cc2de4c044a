"""Pick an attention implementation by backend and shape.

``attention(q, k, v, length, block_mask, impl=...)`` has the contract of
``jaxspec.attention.attend``. ``impl``:

- ``"reference"``: the pure-jnp ``attend`` (any backend, any shape);
- ``"pallas"``: the Pallas split-K kernel, compiled for the GPU (raises off GPU or on shapes it
  does not take);
- ``"pallas_interpret"``: the same kernel through the Pallas interpreter (CPU tests; slow);
- ``"auto"``: ``"pallas"`` when ``jax.default_backend() == "gpu"`` and the shapes fit (head_dim in
  {64, 128}; 1 <= T <= 64; block size N <= 128; q, k, v one of bf16/f16/f32), else
  ``"reference"``.

Everything is decided from static shapes and dtypes, so it works under ``jax.jit``.
"""

from __future__ import annotations

from typing import Literal

import jax
from jaxtyping import Array, Bool, Float, Int

from jaxspec.attention import attend
from pallas_kernels.decode_attention import decode_attention, unsupported_reason

Impl = Literal["auto", "reference", "pallas", "pallas_interpret"]
IMPLS = ("auto", "reference", "pallas", "pallas_interpret")


def choose_impl(q, k, v, block_mask, impl: str = "auto") -> str:
    """The implementation ``attention`` would run for these arrays (``impl`` resolved)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if jax.default_backend() == "gpu" and unsupported_reason(q, k, v, block_mask) is None:
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
) -> Float[Array, "b t h hd"]:
    """Grouped-query attention of T queries over the cache prefix plus their allowed block slots
    (see ``jaxspec.attention.attend``), by the implementation ``impl`` picks."""
    chosen = choose_impl(q, k, v, block_mask, impl)
    if chosen == "reference":
        return attend(q, k, v, length, block_mask)
    if chosen == "pallas" and jax.default_backend() != "gpu":
        raise ValueError(
            f"impl='pallas' needs a GPU backend (have {jax.default_backend()!r}); "
            "use 'pallas_interpret' or 'auto'"
        )
    return decode_attention(q, k, v, length, block_mask, interpret=chosen == "pallas_interpret")
