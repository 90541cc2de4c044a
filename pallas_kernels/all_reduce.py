"""One-shot all-reduce for decode-sized messages: each device writes its partial into every peer's
inbox, then sums the N partials locally, in rank order.

A decode step's reductions carry a few KB (``[rows, d]`` activations: 8 x 4096 bf16 is 64 KB)
and are latency-bound: a ring all-reduce needs 2 (N - 1) dependent hops, NCCL's tree a log N
depth of them plus its launch protocol; the one-shot algorithm needs one hop and one wait (every
device sends N - 1 copies of its partial at once: N x the bytes of a ring, which is nothing at
these sizes). Summing in rank order 0..N-1 on every device makes all replicas bit-identical,
which the tensor-parallel step needs (the residual stream is replicated).

- ``reference(x, axis_name)``: the algorithm in ``jax.lax`` (N - 1 collective permutes, then the
  ordered sum; float32 accumulation). Any backend; the tests compare it with ``psum``.
- ``oneshot(x, axis_name=..., num_devices=...)``: a Mosaic GPU kernel (``plgpu.kernel``). Peers'
  inboxes are the kernel's second output, written through ``plgpu.remote_ref`` (NVLink
  peer-to-peer stores); a semaphore signalled on each peer after its stores orders them before
  its reads, and a second one keeps every device in the kernel until all have read (the next
  call's stores must not land in an inbox still being read). No multicast (``multimem``)
  instruction is used: NVLink multicast is forbidden on the lent machines.
- ``unsupported_reason(x, num_devices)``: why the kernel does not take ``x`` (then use psum).

- ``oneshot_dma(x, axis_name=..., num_devices=..., interpret=...)``: the same protocol as a Pallas
  kernel of remote DMAs and semaphores (the TPU form: ``make_async_remote_copy`` into each peer's
  inbox, a DMA semaphore per shift for the arrivals, a regular one for the drain), which Pallas'
  TPU interpreter runs on a CPU with one thread per device, its race detector on. It is how the
  kernel's protocol and its ordered sum are tested here (``KernelConfig(all_reduce=
  "interpret")`` runs it inside the tensor-parallel step); it is not tuned for a real TPU.

Run inside ``jax.shard_map`` over a mesh axis whose devices are the process's GPUs 0..N-1 (Mosaic
GPU's peer addressing). The GPU interpreter of Pallas (jax 0.11.2) has no remote references or
remote semaphore signals (its jaxpr interpreter has no rule for ``semaphore_signal``), so on a
CPU ``oneshot`` only traces; it is checked on GPUs (``tests/test_all_reduce.py`` with
``JAX_PLATFORMS=cuda``, ``benchmarks/bench_all_reduce.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

TILE = 1024  # elements one warpgroup moves per step: 128 threads x 8
# decode messages are ~8-64 KB; past this a bandwidth-optimal ring (psum) wins
MAX_BYTES = 256 * 1024
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def reference(x: Float[Array, "..."], axis_name: str) -> Float[Array, "..."]:
    """The one-shot all-reduce of ``x`` over ``axis_name`` in ``jax.lax``: device i receives the
    partial of device (i - s) mod N from the permute of shift s, puts the N partials in rank
    order and sums them in that order (float32), so every device returns the same bits."""
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    got = [x] + [
        lax.ppermute(x, axis_name, perm=[(i, (i + s) % n) for i in range(n)]) for s in range(1, n)
    ]
    by_shift = jnp.stack(got)  # [N, ...]: entry s came from rank (me - s) mod N
    by_rank = jnp.take(by_shift, (me - jnp.arange(n)) % n, axis=0)
    acc = by_rank[0].astype(jnp.float32)
    for r in range(1, n):
        acc = acc + by_rank[r].astype(jnp.float32)
    return acc.astype(x.dtype)


def unsupported_reason(x, num_devices: int) -> str | None:
    """Why ``oneshot`` does not take ``x`` on ``num_devices`` devices (None: it does)."""
    if num_devices < 2:
        return "one device: nothing to reduce"
    if jnp.dtype(x.dtype) not in tuple(map(jnp.dtype, DTYPES)):
        return f"dtype {x.dtype} (takes float32, bfloat16, float16)"
    nbytes = x.size * jnp.dtype(x.dtype).itemsize
    if nbytes > MAX_BYTES:
        return f"{nbytes} bytes: more than the {MAX_BYTES} of a decode-sized message"
    return None


def oneshot(x: Float[Array, "..."], *, axis_name: str, num_devices: int) -> Float[Array, "..."]:
    """The one-shot all-reduce of ``x`` over ``axis_name`` as one Mosaic GPU kernel (see the
    module docstring); the same ordered float32 sum as ``reference``."""
    why = unsupported_reason(x, num_devices)
    if why is not None:
        raise ValueError(f"oneshot all-reduce does not take this message: {why}")
    # imported here: Mosaic GPU's and the TPU dialect's modules took 0.46 s of every import of
    # jaxspec on the 2-core CPU, where no all-reduce kernel runs
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n, size = num_devices, x.size
    tiles = -(-size // TILE)
    flat = jnp.pad(x.reshape(-1), (0, tiles * TILE - size)).reshape(tiles, TILE)

    def kernel(x_ref, y_ref, inbox_ref, arrived, drained):
        me = lax.axis_index(axis_name)

        @pl.loop(0, tiles)
        def _keep(i):  # my own partial in my inbox: the sum below reads every slot alike
            inbox_ref[me, i] = x_ref[i]

        for k in range(1, n):  # static: a peer id must be computable from the device id
            peer = lax.rem(me + k, n)
            dst = plgpu.remote_ref(inbox_ref, peer)

            @pl.loop(0, tiles)
            def _send(i, dst=dst):
                dst[me, i] = x_ref[i]

            # ordered after this thread's stores to the peer (the semaphore's contract)
            pl.semaphore_signal(arrived, 1, device_id=peer)
        pl.semaphore_wait(arrived, n - 1)

        @pl.loop(0, tiles)
        def _sum(i):
            acc = inbox_ref[0, i].astype(jnp.float32)
            for r in range(1, n):
                acc = acc + inbox_ref[r, i].astype(jnp.float32)
            y_ref[i] = acc.astype(y_ref.dtype)

        for k in range(1, n):
            pl.semaphore_signal(drained, 1, device_id=lax.rem(me + k, n))
        pl.semaphore_wait(drained, n - 1)

    y, _ = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((tiles, TILE), x.dtype),
            jax.ShapeDtypeStruct((n, tiles, TILE), x.dtype),  # the inbox peers write into
        ),
        scratch_types=[plgpu.SemaphoreType.REGULAR, plgpu.SemaphoreType.REGULAR],
    )(flat)
    return y.reshape(-1)[:size].reshape(x.shape)


def oneshot_dma(
    x: Float[Array, "..."],
    *,
    axis_name: str,
    num_devices: int,
    interpret: bool = True,
    poison: float | None = None,
) -> Float[Array, "..."]:
    """The one-shot all-reduce of ``x`` as remote DMAs (module docstring): device i copies its
    partial into its own inbox slot i, starts one remote copy of it into slot i of each peer's
    inbox, waits for its sends and for the N - 1 arrivals (the copy of shift s signals the
    receiver's semaphore s), sums the N slots in rank order (float32) and, before leaving,
    signals every peer and waits for all of them (no device's next stores into an inbox still
    being read). ``interpret``: through Pallas' TPU interpreter (any backend). ``poison``: the
    output and the inbox start filled with it (tests: a slot read before it arrived, or an
    element never written, shows)."""
    from jax.experimental.pallas import tpu as pltpu  # as plgpu in ``oneshot``

    n = num_devices
    if n < 2:
        raise ValueError("oneshot_dma needs two or more devices")

    def kernel(x_ref, *refs):
        y_ref, inbox_ref, buf, copy_sem, send_sem, recv_sem, drained = refs[-7:]
        me = lax.axis_index(axis_name)
        own = pltpu.make_async_copy(x_ref, inbox_ref.at[me], copy_sem)
        own.start()
        own.wait()
        sends = []
        for k in range(1, n):  # static shifts: the peer is (me + k) mod N
            copy = pltpu.make_async_remote_copy(
                src_ref=x_ref, dst_ref=inbox_ref.at[me], send_sem=send_sem.at[k],
                recv_sem=recv_sem.at[k], device_id=(lax.rem(me + k, n),),
                device_id_type=pl.DeviceIdType.MESH,
            )  # fmt: skip
            copy.start()
            sends.append(copy)
        for copy in sends:
            copy.wait_send()
            copy.wait_recv()  # the arrival from (me - k) mod N, of the same size
        read = pltpu.make_async_copy(inbox_ref, buf, copy_sem)
        read.start()
        read.wait()
        acc = buf[0].astype(jnp.float32)
        for r in range(1, n):
            acc = acc + buf[r].astype(jnp.float32)
        y_ref[...] = acc.astype(y_ref.dtype)
        for k in range(1, n):
            pl.semaphore_signal(
                drained, 1, device_id=(lax.rem(me + k, n),), device_id_type=pl.DeviceIdType.MESH
            )
        pl.semaphore_wait(drained, n - 1)

    vmem, anywhere = pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)
    args, specs, alias = [x], [vmem], {}
    if poison is not None:  # the outputs are these buffers, as they were
        args += [jnp.full(x.shape, poison, x.dtype), jnp.full((n, *x.shape), poison, x.dtype)]
        specs += [vmem, anywhere]
        alias = {1: 0, 2: 1}
    y, _ = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((n, *x.shape), x.dtype),  # the inbox peers write into
        ),
        in_specs=specs,
        out_specs=(vmem, anywhere),
        scratch_shapes=[
            pltpu.VMEM((n, *x.shape), x.dtype),
            pltpu.SemaphoreType.DMA,
            pltpu.SemaphoreType.DMA((n,)),
            pltpu.SemaphoreType.DMA((n,)),
            pltpu.SemaphoreType.REGULAR,
        ],
        input_output_aliases=alias,
        interpret=pltpu.InterpretParams(detect_races=True) if interpret else False,
        compiler_params=pltpu.CompilerParams(collective_id=0),
    )(*args)
    return y
