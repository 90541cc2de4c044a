"""Quantized projections on Hopper's tensor cores (Mosaic GPU): ``x @ w`` for steps of at most
16 rows, the weight streamed by TMA into shared memory, its codes converted into the WGMMA's
register operand and its scales applied to the float32 accumulator: never written anywhere as
floats.

The weight is the WGMMA's A operand (``y^T = w^T x^T``): a warpgroup's 64 (or 128: two
instructions) output channels are its M and the step's rows (padded to 8 or 16) its N, so no
tensor-core row is spent on padding rows beyond 8. The codes must then be K-major, ``[N, K]``,
which ``prepare`` lays out once (``jaxspec.model.quantized.for_wgmma`` at load, not per step):

- 8 bits: ``values.T``, int8 ``[N, K]``;
- 4 bits: the codes unpacked from GGUF's order (a byte holds rows ``j`` and ``j + G/2`` of its
  group, ``quant.low_row``), transposed, the stored ``q + 8`` as the signed ``q``, and packed
  again as int4 ``[N, K]`` in K's own order (rows ``2i`` and ``2i + 1`` a byte), so the
  activations need no permutation. (Reading GGUF's bytes as they are, with the activations'
  columns permuted to match, cost the int4 step one more kernel a layer: H100, c940af5.)

Scales ``[K / group, N]`` stay as stored. One K step of ``bk`` rows lies in one group
(``group % bk == 0``), so its sum takes one scale per output channel, a row of the warpgroup's
channels broadcast over the accumulator's columns (the step's rows). GGUF's groups of 32 and
Q4_1's / AWQ's mins are not laid out: they take ``quant_linear``'s Triton kernel.

Numerics: the codes enter the WGMMA as the integers they are (exact in bf16/f16) and each group's
scales multiply that group's float32 sum in the accumulator, ``sum_g s_g (q_g^T x_g^T)``: the
scale costs ``rows`` products a channel and group, not one for every weight (``channels x bk`` a
K step). Every product is exact in float32, so this is the float32 dequantize-then-matmul
(``reference``: ``x @ (q * s)`` in float32) but for the order of the sums, for bf16 and float32
scales alike. It is not the bf16 dequantize-then-matmul of the XLA path (``quant.dequantize`` to
bf16 rounds each ``q * s`` before its product): the two differ by that rounding, so a bf16 model
whose steps take both paths (16 rows or fewer here, more through XLA) may part at near-ties;
float32 models never take this kernel (the WGMMA takes 16-bit operands).

Program ``(j, s)`` of the grid ``(N / channels, splits)`` runs a pipeline of ``stages`` TMA loads
over its split's K steps and writes float32 partial sums ``[S, N, R]`` (channels major, as the
accumulator holds them); ``qmatmul`` sums them and transposes back, which XLA fuses into one
small kernel after each projection (a direct transposed store is not one Mosaic GPU lowers:
"tiled strides must be a multiple of the vector length"). Compiled, it runs
on a Hopper GPU only; on a CPU, ``interpret=True`` runs it in Mosaic GPU's interpreter (the same
program, the register operand staged through shared memory: the interpreter's WGMMA takes no
other), which the tests check against ``reference`` on fresh inputs, besides lowering it for
CUDA (Mosaic's own layout and shape checks). The compiled products are checked on the GPU
(benchmarks/bench_quantized.py's ``check`` section and tests marked ``gpu``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Shaped

from pallas_kernels import quant
from pallas_kernels.pytree import pytree_dataclass
from pallas_kernels.quant import QuantizedWeight

TN = 64  # output channels a program where TM does not divide a width: one WGMMA's M
MAX_ROWS = 16
TARGET_PROGRAMS = 264  # two programs per SM of an H200 (132 SMs): K splits are added up to this
# K rows a step, pipeline stages and output channels a program (one warpgroup; one WGMMA's M is
# 64), by bits. One H100, CUPTI kernel times, Llama-3-8B's gate/up, down, q at 8
# rows (2026-12-06, benchmarks/notes/quantized.md): int8 256 x 2 stages x 64 channels 22.9 / 22.5
# / 8.4 us (3 stages 23.3 / 23.1 / 8.7, 6: 28.7 / 27.8, fewer programs fit an SM; 128 channels
# 24.2 / 23.9 / 9.4; 512-row steps 24.3 / 23.3 / 9.2); int4 128 x 3 x 128 channels 16.5 / 15.6 /
# 5.3 (64 channels, 4 stages 18.9 / 16.8 / 5.9). A program of one warpgroup issuing its own TMA
# loads beat one or two compute warpgroups fed by a loading one (emit_pipeline_warp_specialized:
# int8 26.4 / 25.2, int4 22.4-26.5 / 20.6-24.1), which is gone. All with the scales on the
# weights (before e69f501). With the scales on the accumulator (H100, 34ec2b7, the loop sweep of
# bench_quantized.py, notes/quantized.md) these tiles stay best or within one run's noise.
BK = {8: 256, 4: 128}
STAGES = {8: 2, 4: 3}
TM = {8: 64, 4: 128}
HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_STATIC = dict(static=True)


@pytree_dataclass
class KMajorWeight:
    """A quantized ``[K, N]`` weight laid out for this kernel (``prepare``): ``values`` int8
    ``[N, K]`` or int4 ``[N, K]`` (the signed codes ``q``, stored ``q + 8``), ``scales [K/group,
    N]``. Static: ``bits``, ``group``, ``dtype`` (the compute dtype)."""

    values: Shaped[Array, "n k"]
    scales: Float[Array, "g n"]
    bits: int = dataclasses.field(metadata=_STATIC)
    group: int = dataclasses.field(metadata=_STATIC)
    dtype: str = dataclasses.field(metadata=_STATIC)

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the matrix it stands for, ``(K, N)``."""
        return self.values.shape[1], self.values.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes a full read of it costs: codes and scales."""
        n, k = self.values.shape
        return n * k * self.bits // 8 + self.scales.size * jnp.dtype(self.scales.dtype).itemsize


def unsupported_weight(w) -> str | None:
    """Why ``prepare`` cannot lay out this weight (None: it can)."""
    if not quant.is_quantized(w):
        return "the weight is not quantized"
    if w.mins is not None:
        return "asymmetric weights (with mins) take the Triton kernel"
    k, n = w.shape
    bk = BK[w.bits]
    if n % TN:
        return f"N={n} is not a multiple of {TN}"
    if k % bk or w.group % bk:
        return f"K={k} in groups of {w.group} does not cut into whole {bk}-row steps"
    return None


def prepare(w: QuantizedWeight) -> KMajorWeight:
    """``w`` laid out K-major for the kernel (module docstring). Run once per weight."""
    why = unsupported_weight(w)
    if why is not None:
        raise ValueError(f"quant_wgmma.prepare: {why}")
    if w.bits == 8:
        values = jnp.asarray(w.values).T
    else:
        signed = jnp.asarray(quant.codes(w)).astype(jnp.int8) - quant.OFFSET4
        values = signed.T.astype(jnp.int4)
    return KMajorWeight(values, jnp.asarray(w.scales), w.bits, w.group, w.dtype)


def device_supported(device=None) -> bool:
    """Whether ``device`` (default: JAX's first) runs this kernel: WGMMA is Hopper's (sm_90)."""
    device = device or jax.devices()[0]
    cap = str(getattr(device, "compute_capability", ""))
    return device.platform == "gpu" and cap.split(".")[0] == "9"


def dequantize(w: KMajorWeight, dtype=None) -> Float[Array, "k n"]:
    """The float matrix ``[K, N]`` in ``dtype`` (default ``w.dtype``): ``quant.dequantize``'s
    value to the bit (``q * s`` in float32, one rounding)."""
    q = w.values.astype(jnp.float32).T
    s = jnp.repeat(w.scales.astype(jnp.float32), w.group, axis=0)
    return (q * s).astype(dtype or w.dtype)


def reference(x: Float[Array, "m k"], w) -> Float[Array, "m n"]:
    """What ``qmatmul`` computes, in float32 throughout: ``x @ (q * s)`` with the weight
    dequantized in float32 (exact: an 8-bit code times a 16-bit scale) and the rows widened."""
    kmajor = isinstance(w, KMajorWeight)
    wf = dequantize(w, jnp.float32) if kmajor else quant.dequantize(w, jnp.float32)
    return jnp.matmul(x.astype(jnp.float32), wf, precision=jax.lax.Precision.HIGHEST)


def unsupported_reason(x, w) -> str | None:
    """Why ``qmatmul`` cannot take rows ``x`` (None when it can)."""
    if not isinstance(w, KMajorWeight):
        return "the weight is not laid out by quant_wgmma.prepare"
    if x.ndim != 2 or x.shape[1] != w.shape[0]:
        return f"rows {x.shape} do not take a weight of shape {w.shape}"
    if not 1 <= x.shape[0] <= MAX_ROWS:
        return f"{x.shape[0]} rows not in [1, {MAX_ROWS}]"
    if jnp.dtype(x.dtype) != jnp.dtype(w.dtype):
        return f"rows of {x.dtype} with a weight computing in {w.dtype}"
    if jnp.dtype(w.dtype) not in HALF:
        return f"compute dtype {w.dtype}: the WGMMA takes bf16/f16 operands (float32: tf32)"
    return None


def plan(k: int, n: int, bk: int, splits: int | None, cta: int = 64) -> tuple[int, int]:
    """``(splits, K steps a split)``: about ``splits`` (None: enough for ``TARGET_PROGRAMS``),
    each the same whole number of ``bk``-row steps."""
    steps = k // bk
    if splits is None:
        splits = max(1, TARGET_PROGRAMS // (n // cta))
    splits = max(1, min(splits, steps))
    per = next(p for p in range(math.ceil(steps / splits), steps + 1) if steps % p == 0)
    return steps // per, per


def _swizzle(elems: int, dtype) -> tuple:
    bits = jnp.dtype(dtype).itemsize * 8 if dtype != jnp.int4 else 4
    sw = plgpu.find_swizzle(elems * bits, "quant_wgmma")
    return (plgpu.TilingTransform((8, sw * 8 // bits)), plgpu.SwizzleTransform(sw))


def _codes(w_smem, bits: int, dt):
    """A K step's codes from shared memory into the WGMMA's register layout, as ``dt``: the
    integers themselves (exact in bf16/f16), no scale yet."""
    upcast = plgpu.Layout.WGMMA_UPCAST_2X if bits == 8 else plgpu.Layout.WGMMA_UPCAST_4X
    return plgpu.layout_cast(plgpu.load(w_smem, layout=upcast), plgpu.Layout.WGMMA).astype(dt)


def _mma(acc, a, b, interpret: bool):
    """``acc += a @ b`` on the tensor cores, ``a`` from registers. The GPU interpreter takes
    only shared-memory operands, so interpreted ``a`` is staged through shared memory first."""
    if not interpret:
        plgpu.wgmma(acc, a, b)
        return

    def staged(a_smem):
        a_smem[...] = a
        plgpu.wgmma(acc, a_smem, b)

    pl.run_scoped(staged, plgpu.SMEM(a.shape, a.dtype))


def _scaled(s_smem, value):
    """``value [channels, rows]`` (float32) times its channels' scales (``s_smem [channels]``)."""
    scale = plgpu.load(s_smem, layout=plgpu.Layout.WGMMA.reduce(1)).astype(jnp.float32)
    return value * jax.lax.broadcast_in_dim(scale, value.shape, (0,))


def one_group_a_split(per_group: int, per: int) -> bool:
    """Whether every split of ``per`` K steps lies in one scale group of ``per_group`` steps
    (per-channel int8): then its scales apply once, to the split's sum (``_accumulate``)."""
    return per_group % per == 0


def _accumulate(
    x_gmem, w_gmem, s_gmem, specs, out, *, per, per_group, stages, bits, dt, shape, interpret
):
    """Store into ``out`` a split's ``sum_g s_g * (q_g^T x_g^T)`` in float32: the codes go into
    the WGMMA as the integers they are, and the scales multiply float32 sums in the accumulator
    (a ``[channels, rows]`` tile: ``rows`` products a channel) instead of every weight before the
    WGMMA (``channels x bk`` products a K step): once, after the split's last step, where the
    split lies in one group; else each K step's own sum (a step lies in one group). Exact
    products, float32 sums: the float32 dequantize-then-matmul's value but for the order of the
    sums."""
    pipeline = functools.partial(
        plgpu.emit_pipeline, grid=(per,), in_specs=specs, max_concurrent_steps=stages
    )
    if one_group_a_split(per_group, per):

        def body(acc):
            def step(idx, x_smem, w_smem, s_smem):
                _mma(acc, _codes(w_smem, bits, dt), x_smem.T, interpret)
                plgpu.wgmma_wait(0)

                @pl.when(idx[0] == per - 1)
                def _():
                    out[...] = _scaled(s_smem.at[0], acc[...])

            pipeline(step)(x_gmem, w_gmem, s_gmem)

        pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))
        return

    def step(idx, x_smem, w_smem, s_smem, total):
        def product(acc):
            _mma(acc, _codes(w_smem, bits, dt), x_smem.T, interpret)
            return acc[...]

        return total + _scaled(s_smem.at[0], pl.run_scoped(product, plgpu.ACC(shape, jnp.float32)))

    zero = jnp.zeros(shape, jnp.float32)
    out[...] = pipeline(step, init_carry=zero)(x_gmem, w_gmem, s_gmem)


def group_problem(ws) -> str | None:
    """Why these weights cannot share one launch (None: they can): one launch reads one
    activation tile a K step of one size, so they need the same K, bits and compute dtype."""
    w0 = ws[0]
    for w in ws[1:]:
        if (w.shape[0], w.bits, w.dtype) != (w0.shape[0], w0.bits, w0.dtype):
            return "weights of different K, bits or compute dtype"
    return None


@functools.partial(jax.jit, static_argnames=("bk", "splits", "stages", "tm", "interpret"))
def qmatmul_partials(
    x: Float[Array, "r k"],
    ws: tuple[KMajorWeight, ...],
    *,
    bk: int | None = None,
    splits: int | None = None,
    stages: int | None = None,
    tm: int | None = None,
    interpret: bool = False,
) -> Float[Array, "s n r"]:
    """Float32 partial sums ``[S, N, R]`` of ``x @ concat(ws)`` transposed (``N``: the weights'
    columns side by side), in one launch; ``x`` has ``R`` (8 or 16) rows (``qmatmul`` pads
    them). Program ``(j, s)`` takes column tile ``j`` of whichever weight
    holds it. ``tm``: output channels a program (64 or 128)."""
    why = group_problem(ws)
    if why is not None:
        raise ValueError(f"quant_wgmma: {why}")
    r, k = x.shape
    w0 = ws[0]
    widths = [w.values.shape[0] for w in ws]
    n = sum(widths)
    bk = bk or BK[w0.bits]
    tm = tm or (TM[w0.bits] if all(c % TM[w0.bits] == 0 for c in widths) else TN)
    if any(c % tm for c in widths):
        raise ValueError(f"quant_wgmma: widths {widths} are not multiples of {tm}")
    n_split, per = plan(k, n, bk, splits, tm)
    stages = max(1, min(stages or STAGES[w0.bits], per))
    dt = jnp.dtype(w0.dtype)
    wdt = jnp.int8 if w0.bits == 8 else jnp.int4
    x_tiles, w_tiles = _swizzle(bk, dt), _swizzle(bk, wdt)
    starts = [sum(widths[:i]) // tm for i in range(len(ws))]  # each weight's first tile

    def tile(x_gmem, w_gmem, s_gmem, o_gmem, w, j, s, first):
        """Program ``(j, s)``'s tile ``j - first`` of weight ``w``."""
        jj = j - first
        per_group = w.group // bk  # K steps a scale row covers

        def kstep(i):
            return s * per + i

        specs = [
            plgpu.BlockSpec((r, bk), lambda i: (0, kstep(i)), transforms=x_tiles),
            plgpu.BlockSpec((tm, bk), lambda i: (jj, kstep(i)), transforms=w_tiles),
            plgpu.BlockSpec((1, tm), lambda i: (kstep(i) // per_group, jj)),
        ]

        out = o_gmem.at[pl.ds(s * n + j * tm, tm), :]
        _accumulate(
            x_gmem, w_gmem, s_gmem, specs, out, per=per, per_group=per_group, stages=stages,
            bits=w0.bits, dt=dt, shape=(tm, r), interpret=interpret,
        )  # fmt: skip

    def kernel(x_gmem, *refs):
        *pairs, o_gmem = refs
        j, s = jax.lax.axis_index("n"), jax.lax.axis_index("s")
        for i, w in enumerate(ws):
            args = (x_gmem, pairs[2 * i], pairs[2 * i + 1], o_gmem, w, j, s, starts[i])
            if len(ws) == 1:
                tile(*args)
            else:
                last = starts[i] + widths[i] // tm
                pl.when((j >= starts[i]) & (j < last))(functools.partial(tile, *args))

    arrays = [a for w in ws for a in (w.values, w.scales)]
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((n_split * n, r), jnp.float32),
        grid=(n // tm, n_split),
        grid_names=("n", "s"),
        kernel_name=f"qmatmul_wgmma_int{w0.bits}",
        compiler_params=plgpu.CompilerParams(approx_math=False),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(x, *arrays)
    return out.reshape(n_split, n, r)


def rows_for(m: int) -> int:
    return 8 if m <= 8 else 16


def qmatmul(
    x: Float[Array, "m k"],
    w: KMajorWeight | tuple[KMajorWeight, ...],
    *,
    bk=None,
    splits=None,
    stages=None,
    tm=None,
    interpret: bool = False,
) -> Float[Array, "m n"]:
    """``x @ w`` in float32 (``x`` of at most 16 rows in the weights' compute dtype); a tuple of
    weights (``group_problem``: None) in one launch, their columns side by side."""
    ws = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"quant_wgmma.qmatmul: {m} rows not in [1, {MAX_ROWS}]")
    xp = jnp.pad(x, ((0, rows_for(m) - m), (0, 0)))
    parts = qmatmul_partials(
        xp, ws, bk=bk, splits=splits, stages=stages, tm=tm, interpret=interpret
    )
    return jnp.sum(parts, axis=0)[:, :m].T
