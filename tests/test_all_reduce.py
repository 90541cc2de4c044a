"""The one-shot all-reduce (pallas_kernels/all_reduce.py): its jax.lax reference against psum on
the forced host devices; its protocol as a Pallas kernel of remote DMAs (``oneshot_dma``) through
Pallas' TPU interpreter against the reference, on fresh random inputs with poisoned outputs and
inboxes and the race detector on; the Mosaic GPU kernel against the reference on GPUs.

The GPU interpreter of Pallas (jax 0.11.2) cannot run the Mosaic GPU kernel on a CPU: it has no
rule for remote references or remote semaphore signals. So that kernel's test needs two or more
GPUs (``JAX_PLATFORMS=cuda python -m pytest tests/test_all_reduce.py``, benchmarks/gpu/tp.sh); on
a CPU it only traces (its jaxpr is built: shapes, indexing, the peer loop)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
from jax.sharding import AxisType, PartitionSpec

from pallas_kernels import all_reduce as AR

AXIS = "tp"


def _mesh(n: int):
    return jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n], axis_types=(AxisType.Auto,))


def _per_device(fn, n: int, check_vma=True):
    """``fn`` on each device's ``[rows, d]`` block of a ``[n * rows, d]`` array; the results
    stacked the same way (so each device's copy of a reduction can be compared)."""
    spec = PartitionSpec(AXIS)
    return jax.jit(
        jax.shard_map(fn, mesh=_mesh(n), in_specs=spec, out_specs=spec, check_vma=check_vma)
    )


@pytest.mark.parametrize(
    "n, dtype",
    [(8, jnp.float32), (4, jnp.bfloat16)]
    + [pytest.param(n, d, marks=pytest.mark.slow) for n, d in
       ((2, jnp.float32), (4, jnp.float32), (2, jnp.bfloat16), (8, jnp.bfloat16))],
)  # fmt: skip
def test_oneshot_reference_equals_psum_and_is_the_same_on_every_device(n, dtype):
    rows, d = 8, 96  # a decode step's padded rows
    x = jax.random.normal(jax.random.key(n), (n * rows, d), jnp.float32).astype(dtype)
    got = np.asarray(_per_device(lambda b: AR.reference(b, AXIS), n)(x), np.float32)
    want = np.asarray(_per_device(lambda b: jax.lax.psum(b, AXIS), n)(x), np.float32)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    parts = np.asarray(x, np.float32).reshape(n, rows, d)
    ordered = parts[0]
    for r in range(1, n):  # the float32 sum in rank order, rounded once
        ordered = ordered + parts[r]
    ordered = np.asarray(jnp.asarray(ordered).astype(dtype), np.float32)
    copies = got.reshape(n, rows, d)
    for c in copies:  # every device returns the same bits: the replicas stay identical
        np.testing.assert_array_equal(c, ordered)


def _races_found() -> bool:
    """What the TPU interpreter's race detector saw (its state has no public API)."""
    return bool(ipc.races is not None and ipc.races.races_found)


def _ordered_sum(parts: np.ndarray, dtype) -> np.ndarray:
    """The float32 sum of ``parts [n, ...]`` in rank order, rounded once to ``dtype``."""
    acc = parts[0].astype(np.float32)
    for p in parts[1:]:
        acc = acc + p.astype(np.float32)
    return np.asarray(jnp.asarray(acc).astype(dtype), np.float32)


@pytest.mark.parametrize(
    "n, shape, dtype",
    [(2, (8, 96), jnp.float32), (8, (1, 64), jnp.float32)]
    + [pytest.param(4, (3, 40), jnp.bfloat16, marks=pytest.mark.slow)],
)
def test_oneshot_dma_kernel_interpreted_equals_the_reference(n, shape, dtype):
    """Every device returns the rank-ordered sum bit for bit, though its output and inbox start
    as NaN (an element left unwritten, or a slot read before its copy arrived, would show) and
    the interpreter's race detector watches every access; two calls back to back (the drain
    keeps the second call's copies out of an inbox still being read)."""
    seed = np.random.SeedSequence().entropy % (2**31)  # fresh inputs each run: printed on failure
    x = jax.random.normal(jax.random.key(seed), (n * shape[0], *shape[1:]), jnp.float32)
    x = (x * 4).astype(dtype)
    kernel = functools.partial(AR.oneshot_dma, axis_name=AXIS, num_devices=n, poison=np.nan)
    run = _per_device(kernel, n, check_vma=False)
    want = np.asarray(_per_device(lambda b: AR.reference(b, AXIS), n)(x), np.float32)
    parts = np.asarray(x, np.float32).reshape(n, *shape)
    np.testing.assert_array_equal(want.reshape(n, *shape)[0], _ordered_sum(parts, dtype))
    for _ in range(2):
        got = np.asarray(run(x), np.float32)
        np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")
    assert not _races_found(), f"seed {seed}"


def test_oneshot_kernel_takes_decode_sized_float_messages_only():
    assert AR.unsupported_reason(jnp.zeros((8, 4096), jnp.bfloat16), 2) is None
    assert "bytes" in AR.unsupported_reason(jnp.zeros((64, 4096), jnp.float32), 2)
    assert "dtype" in AR.unsupported_reason(jnp.zeros((8, 16), jnp.int32), 2)
    assert "one device" in AR.unsupported_reason(jnp.zeros((8, 16)), 1)
    with pytest.raises(ValueError, match="two or more"):
        AR.oneshot_dma(jnp.ones((2, 8)), axis_name=AXIS, num_devices=1)


def test_oneshot_kernel_traces_on_any_backend():
    n, x = 2, jnp.ones((2 * 3, 1000), jnp.bfloat16)  # not a multiple of the tile: padded
    fn = functools.partial(AR.oneshot, axis_name=AXIS, num_devices=n)
    spec = PartitionSpec(AXIS)
    jaxpr = jax.make_jaxpr(
        jax.shard_map(fn, mesh=_mesh(n), in_specs=spec, out_specs=spec, check_vma=False)
    )(x)
    assert jaxpr.out_avals[0].shape == x.shape
    assert "semaphore_signal" in str(jaxpr) and "PeerMemRef" in str(jaxpr)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096), (8, 4096), (3, 1000)])
def test_oneshot_kernel_equals_the_reference_on_gpus(shape):
    """The Mosaic GPU kernel itself (no interpreter runs it): selected by ``-m gpu`` on a lent
    machine of 2+ GPUs (benchmarks/gpu/tp.sh), deselected elsewhere."""
    assert jax.default_backend() == "gpu" and jax.device_count() >= 2, "needs 2+ GPUs"
    for n in sorted({2, jax.device_count()} & {2, 4, 8}):
        x = jax.random.normal(jax.random.key(0), (n * shape[0], shape[1]), jnp.bfloat16)
        kernel = functools.partial(AR.oneshot, axis_name=AXIS, num_devices=n)
        run = _per_device(kernel, n, check_vma=False)
        want = np.asarray(_per_device(lambda b: AR.reference(b, AXIS), n)(x))
        for _ in range(4):  # back to back: no call's stores land in another's inbox
            np.testing.assert_array_equal(np.asarray(run(x)), want)
