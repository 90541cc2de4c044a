"""The tree engines' cache commit as one kernel for every layer's K and V cache.

After a tree verify the target keeps the root and the accepted path: the K/V rows at block slots
``src[b, i]`` move to ``length[b] + i`` (``jaxspec.model.kv_cache.commit``). The plain path does
that with a gather and a scatter per cache: 60 caches in SmolLM2, so likely ~120 small kernels a
verify (not counted yet). That would explain the 0.3 ms by which a tree verify of 9 nodes
outlasted a chain verify of 9 tokens on the H200 (1.16 against 0.85 ms;
git show 785ba73:benchmarks/notes/small_model_trees_s9.md). A chain commits by moving ``length``
only.

Here one ``pallas_call`` takes every cache (aliased: updated in place). Program ``(c, b)`` moves
row ``b`` of cache ``c``: it loads the rows at ``src`` into registers, waits at a barrier for
every thread of the program to have loaded, then stores them at their destinations. The barrier
matters: a destination can be another row's source (``src = L + [0, 2, 3]`` writes slot ``L + 2``
while that slot is read for ``L + 1``). Rows past ``count`` and destinations past the capacity
are not written.

The GPU default (``KernelConfig.fused_commit``, ``jaxspec/kernels.py`` cites its measurement);
``JAXSPEC_FUSED_COMMIT=off`` in the CLI turns it off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def reference(caches, src, dst):
    """Each cache with rows ``src[b, i]`` copied to ``dst[b, i]`` (read before any write);
    destinations at or past the capacity are dropped."""
    rows = jnp.arange(src.shape[0])[:, None]

    def move(x):
        return x.at[rows, dst].set(x[rows, jnp.clip(src, 0, x.shape[1] - 1)], mode="drop")

    return [move(x) for x in caches]


def _kernel(src_ref, dst_ref, *refs, n: int, k: int, kp: int, s: int, w: int, wp: int, barrier):
    ins, outs = refs[:n], refs[n:]
    c = pl.program_id(0)
    i = jnp.arange(kp)
    real = i < k
    src = plgpu.load(src_ref.at[pl.ds(0, kp)], mask=real, other=0)
    dst = plgpu.load(dst_ref.at[pl.ds(0, kp)], mask=real, other=s)
    col = jnp.arange(wp)[None, :]
    src2, dst2 = (jnp.broadcast_to(x[:, None], (kp, wp)) for x in (src, dst))
    col2 = jnp.broadcast_to(col, (kp, wp))
    read = (real & (src >= 0) & (src < s))[:, None] & (col < w)
    write = (real & (dst >= 0) & (dst < s))[:, None] & (col < w)
    for j in range(n):

        @pl.when(c == j)
        def _(j=j):
            rows = plgpu.load(ins[j].at[src2, col2], mask=read, other=0.0)
            if barrier:  # every thread's loads done before any store (sources may be targets)
                plgpu.debug_barrier()
            plgpu.store(outs[j].at[dst2, col2], rows, mask=write)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def move_rows(
    caches: list[Float[Array, "b s kh hd"]],
    src: Int[Array, "b k"],
    dst: Int[Array, "b k"],
    *,
    interpret: bool = False,
) -> list[Float[Array, "b s kh hd"]]:
    """``reference`` in one kernel; the caches are donated (updated in place)."""
    n = len(caches)
    b, s, kh, hd = caches[0].shape
    k, w = src.shape[1], kh * hd
    flat = [x.reshape(b, s, w) for x in caches]
    kern = functools.partial(
        _kernel, n=n, k=k, kp=_pow2(max(k, 16)), s=s, w=w, wp=_pow2(w), barrier=not interpret
    )
    row = pl.BlockSpec((None, s, w), lambda c, bb: (bb, 0, 0))
    idx = pl.BlockSpec((None, k), lambda c, bb: (bb, 0))
    out = pl.pallas_call(
        kern,
        grid=(n, b),
        in_specs=[idx, idx] + [row] * n,
        out_specs=[row] * n,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat],
        input_output_aliases={2 + j: j for j in range(n)},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxspec_kv_commit",
    )(src.astype(jnp.int32), dst.astype(jnp.int32), *flat)
    return [x.reshape(b, s, kh, hd) for x in out]
