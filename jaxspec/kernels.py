"""``KernelConfig``: which kernels a compiled program runs, as one frozen, hashable value.

Every program the engines compile takes its models' resolved ``KernelConfig`` as part of a static
argument (``model.transformer.Net``), so two configs are two programs, found apart in every
compile cache, and nothing is read from the environment while tracing.

``KernelConfig()`` leaves each choice to ``resolve``, which fills it from the backend and the
model's size by ``DEFAULTS`` below, each row citing the measurement that chose it. A resolved
config names concrete implementations only: ``"pallas"`` means "the Pallas kernel wherever it
takes the shapes, the plain path elsewhere" (the kernels check shapes while tracing);
``"interpret"`` the same kernels through the Pallas interpreter (CPU tests); ``"off"`` /
``"reference"`` the plain XLA path. Programs over arrays laid out on several devices (tensor
parallel weights, SwiftSpec's two-device program) resolve with ``sharded=True``: the fused
kernels have no partitioning rule, so they stay off there (the attention kernels have one).

Tensor parallelism has two forms (``tensor_parallel``): ``"gspmd"`` runs the one-device forward on
sharded weights and lets XLA's partitioner place the collectives; ``"shard_map"`` runs the
explicit Megatron step of ``model/tensor_parallel.py`` (one reduction after attention and one
after the MLP, the vocabulary split in the embedding, the LM head and the argmax), whose
reductions are ``all_reduce``: ``"psum"`` (XLA's all-reduce: NCCL on a GPU), ``"oneshot"`` (the
Mosaic GPU one-shot kernel of ``pallas_kernels/all_reduce.py`` for decode-sized messages, psum for
larger ones), ``"oneshot_reference"`` (that algorithm in ``jax.lax``: collective permutes) or
``"interpret"`` (the algorithm as the kernel of remote DMAs, through Pallas' interpreter: tests).

``from_env`` reads the ``JAXSPEC_*`` variables into a config; only the CLI and the benchmark
scripts call it. A bad value anywhere is an ``OptionError`` naming the setting and its choices.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.errors import OptionError
from pallas_kernels import decode_attention, fused_linear

FUSED = ("auto", "off", "pallas", "interpret")
ATTENTION = ("auto", "reference", "pallas", "interpret")
PREFILL_ATTENTION = ("auto", "off", "cudnn", "xla")
PADDING = ("auto", "stream", "gemm")
QUANT = ("auto", "xla", "pallas", "interpret")
TENSOR_PARALLEL = ("auto", "gspmd", "shard_map")
ALL_REDUCE = ("auto", "psum", "oneshot", "oneshot_reference", "interpret")

# Defaults by backend. GPU figures: one H200, jax 0.11.2 (benchmarks/RESULTS.md has each run).
DEFAULTS = {
    "cpu": dict(
        attention="reference",  # the kernels are GPU kernels; the interpreter is for tests
        prefill_attention="off",  # cuDNN is a GPU library ("xla": the same call, for tests)
        fused_attention="off",
        fused_linear="off",
        fused_commit="off",
        linear_rows=16,  # every row count the kernels take (the tests run them interpreted)
        gemm_rows=0,  # XLA's CPU GEMMs gain nothing from padded rows
        row_padding="stream",
        prefill_chunk=256,
        loop_chunk=1,  # the stop check is cheap; steps after the last row is done are waste
        # quantized weights kept (load(quantized=True)): dequantize, then XLA's dot (the
        # Pallas kernels are GPU kernels); jaxspec.io.convert.KEEP_QUANTIZED has the timings
        quant_matmul="xla",
        # the measured-safe form until the explicit step is measured (forced host devices share
        # the cores: a CPU says nothing of a GPU's collectives)
        tensor_parallel="gspmd",
        all_reduce="psum",  # the one-shot kernel is a GPU kernel
    ),
    "gpu": dict(
        # split-K decode attention (pallas_kernels/decode_attention.py) and the flash kernel for
        # prefill chunks: the 4K prefill of the SmolLM2 shape 43.4 -> 14.0 ms (prefill_probe)
        attention="pallas",
        # a prompt's first chunk (an empty cache) through cuDNN's flash attention: 4K prefill of
        # the SmolLM2 shape 13.99 ms (the flash kernel, 2048-token chunks) -> 7.20 (cuDNN, one
        # chunk), its attention 7.40 -> 2.06 ms of kernels; the real SmolLM2's first token after
        # a 4K prompt 16.1 -> 9.2-9.5 ms (one H100, benchmarks/results/prefill_probe.json)
        prefill_attention="cudnn",
        # RoPE + cache write + attention in one kernel: SmolLM2-shape step 1.023 -> 0.941 ms,
        # 121 of its 491 kernels gone (benchmarks/results/small_step_probe.json)
        fused_attention="pallas",
        # split-K projection kernels, BN 64 x BK 128 x 4 warps: SmolLM2-shape step, B=1, 1K,
        # 0.858 -> 0.663 ms, 341 -> 161 kernels (probe_small; 128 x 128: 0.731, 64 x 64: 1.007);
        # Q/K/V's BK 256 (3 partials for the attention kernel to sum, not 5): 0.6-2.4% off the
        # step at 1K, 2.0-3.1% at 4K, two H100 calls (qkv_split.json). Layers of 1B and up keep
        # the plain path (fused_linear.layer_problem)
        fused_linear="pallas",
        linear_tile=(64, 128, 4, 256),
        # ...for one-row steps only: a 5- / 16-token verify through them 0.978 / 0.978 ms, through
        # XLA's GEMMs 0.803 / 0.871 (one H100, verify_probe.json)
        linear_rows=1,
        fused_commit="pallas",  # one kernel moves a verify's K/V: 2.117 -> 2.080 ms (verify.json)
        # 8 GEMM rows for steps of fewer: Llama-3-8B-shape decode 5.81 -> 4.89 ms, 1B 1.64 ->
        # 1.20, SmolLM2 1.40 -> 1.10 (gpu_decode.json); results per row unchanged. 9-15 rows
        # pad to 16 (layers.stream_rows): a 9-token verify 0.89 -> 0.865 ms (verify_probe.json)
        gemm_rows=8,
        # the padding on the residual stream, not around each GEMM: 0.941 -> 0.827 ms with the
        # fused attention kernel (benchmarks/results/small_step_probe.json)
        row_padding="stream",
        prefill_chunk=None,  # by batch: prefill_tokens()
        loop_chunk=None,  # by engine: loop_steps()
        # quantized projections of steps of at most 16 rows dequantize in the kernel, never
        # materialising a float copy of the weight: Hopper's WGMMA kernel for weights laid out
        # K-major (pallas_kernels/quant_wgmma.py; Llama-3-8B-shape step int8 4.14 / int4 3.30 ms
        # against 6.10 bf16 on one H100, benchmarks/results/quantized.json; 5.47 / 4.63 through
        # the Triton kernel; H200, in git: 3.52 / 3.20 against 4.74), Triton (quant_linear.py)
        # for the rest
        quant_matmul="pallas",
        quant_tile=None,
        # GSPMD over two H200s: Llama-3-8B-shape step 6.0 ms against 4.75 on one GPU
        # (gpu_decode.json); the shard_map step and the one-shot kernel stay opt-in until
        # benchmarks/gpu/tp.sh measures them (no multi-GPU machine was lent when they were written)
        tensor_parallel="gspmd",
        all_reduce="psum",
    ),
}
# XLA's command kinds that run inside a command buffer (a CUDA graph, with conditional nodes for
# the two loop kinds): those a step launches (fusions, GEMMs, the Pallas kernels' custom calls)
# and the loops, so a data-dependent ``while`` runs on the device instead of from the host. A
# program's options take the whole list ("+WHILE" is XLA_FLAGS' syntax only).
COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"

# A GPU prefill step takes up to this many tokens (rows x chunk), at most GPU_PREFILL_CHUNK a
# row: at 4096 prompt tokens of the SmolLM2 shape 256-token chunks took 43.4 ms, 1024 15.9, 2048
# 14.0, 4096 15.3 (an H200, the flash kernel for every chunk; git show b79a383:
# benchmarks/results/prefill_probe.json). With the first chunk through cuDNN
# (prefill_attention="cudnn") a row takes up to CUDNN_PREFILL_CHUNK: one chunk of 8192 took an
# 8K prompt 14.46 ms against 27.50 in 4096s and 30.33 in 2048s (the later chunks go through the
# flash kernel), a 4K prompt 7.20 in one chunk against 11.74 (one H100, prefill_probe.json).
GPU_PREFILL_TOKENS = 16384
GPU_PREFILL_CHUNK = 2048
CUDNN_PREFILL_CHUNK = 8192
MIN_PREFILL_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Which kernels run. ``"auto"`` / ``None`` fields are filled by ``resolve``.

    attention:       decode and prefill attention: "reference" (jnp), "pallas", "interpret".
    prefill_attention: a prompt's first chunk (``Block.fresh``: an empty cache) wider than the
                     decode kernel takes: "cudnn" (``jax.nn.dot_product_attention`` on cuDNN's
                     flash attention over the chunk's own K/V, for bf16/f16), "xla" (the same
                     call through XLA: any backend, tests), "off" (``attention``'s path). Other
                     blocks take ``attention``'s.
    attention_tile:  (block_k, num_stages, min_split, num_warps) of the split-K decode kernel
                     and the fused attention kernel (None entries, or a shorter tuple: its own
                     heuristics, ``pallas_kernels.decode_attention.plan``).
    fused_attention: the RoPE + cache write + attention kernel for decode and verify blocks.
    fused_linear:    the split-K projection kernels for steps of at most 16 rows.
    linear_tile:     (BN, BK, warps) of those kernels, and optionally the Q/K/V projection's
                     own BK (None: BK): the partials the fused attention kernel sums.
    linear_rows:     the most rows (batch x tokens) of a step those kernels take (at most 16).
    fused_commit:    one kernel moving a verify's committed K/V rows in every cache.
    quant_matmul:    quantized projections of steps of at most 16 rows: "pallas" (dequantized in
                     the kernel: quant_wgmma's for K-major weights, quant_linear's for the
                     rest), "interpret", "xla" (dequantize, then XLA's GEMM); more rows
                     always take "xla".
    quant_tile:      (BN, BK, K splits, warps, stages) of the Triton kernel (None entries: its own
                     defaults; splits None: enough programs to fill the GPU).
    gemm_rows:       steps of fewer rows are padded to this many for the GEMMs (0: never); with
                     row_padding "stream", steps of fewer than twice as many to twice it.
    row_padding:     where: "stream" (the residual stream, once) or "gemm" (around each GEMM).
    prefill_chunk:   prompt tokens a row per prefill step (a multiple of 16); None: by batch.
    loop_chunk:      decode-loop iterations per check of the stop condition; None: by engine.
    tensor_parallel: how a program over sharded weights runs: "gspmd" or "shard_map" (above).
    all_reduce:      the reductions of the "shard_map" step: "psum", "oneshot" (GPU kernel where
                     it applies), "oneshot_reference" (the same algorithm in jax.lax),
                     "interpret" (its remote-DMA kernel, interpreted: any backend, slow).
    invariant:       every reduction exact (``model/exact.py``): a row's result independent of
                     what else its step computes, so speculative output equals autoregressive
                     output bit for bit, in bf16 too. Several times slower; the fused kernels
                     and the attention kernels are off. Applies to the target (drafts keep
                     theirs: they change how many tokens are accepted, never which).
    """

    attention: str = "auto"
    prefill_attention: str = "auto"
    attention_tile: tuple[int | None, ...] | None = None
    fused_attention: str = "auto"
    fused_linear: str = "auto"
    linear_tile: tuple[int | None, ...] | None = None  # checked in __post_init__
    linear_rows: int | None = None
    fused_commit: str = "auto"
    quant_matmul: str = "auto"
    quant_tile: tuple[int | None, int | None, int | None, int | None, int | None] | None = None
    gemm_rows: int | None = None
    row_padding: str = "auto"
    prefill_chunk: int | None = None
    loop_chunk: int | None = None
    tensor_parallel: str = "auto"
    all_reduce: str = "auto"
    invariant: bool = False
    resolved: bool = dataclasses.field(default=False, repr=False)

    def __post_init__(self):
        for name, choices in (
            ("attention", ATTENTION),
            ("prefill_attention", PREFILL_ATTENTION),
            ("fused_attention", FUSED),
            ("fused_linear", FUSED),
            ("fused_commit", FUSED),
            ("row_padding", PADDING),
            ("quant_matmul", QUANT),
            ("tensor_parallel", TENSOR_PARALLEL),
            ("all_reduce", ALL_REDUCE),
        ):
            if getattr(self, name) not in choices:
                raise OptionError(
                    f"KernelConfig.{name} must be one of {', '.join(choices)}; got "
                    f"{getattr(self, name)!r}."
                )
        if (tile := self.linear_tile) is not None:
            pow2 = (*tile[:2], *(v for v in tile[3:4] if v is not None))
            if len(tile) not in (3, 4) or not all(_pow2(v) for v in pow2):
                raise OptionError(
                    f"KernelConfig.linear_tile is (BN, BK, warps) or (BN, BK, warps, Q/K/V's "
                    f"BK) with BN and the BKs powers of two >= 16; got {tile!r}."
                )
            if not _positive(tile[2]):
                raise OptionError(f"linear_tile's warps must be positive, got {tile}.")
        if (problem := decode_attention.tile_problem(self.attention_tile)) is not None:
            raise OptionError(f"KernelConfig.attention_tile: {problem}; {self.attention_tile!r}.")
        if self.linear_rows is not None and not (
            _int(self.linear_rows) and 1 <= self.linear_rows <= 16
        ):
            raise OptionError(
                f"KernelConfig.linear_rows must be an integer from 1 to 16: {self.linear_rows!r}."
            )
        if self.quant_tile is not None:
            _check_quant_tile(self.quant_tile)
        if self.gemm_rows is not None and (not _int(self.gemm_rows) or self.gemm_rows < 0):
            raise OptionError(
                f"KernelConfig.gemm_rows must be an integer >= 0: {self.gemm_rows!r}."
            )
        if self.prefill_chunk is not None and not (
            _int(self.prefill_chunk) and self.prefill_chunk >= 16 and self.prefill_chunk % 16 == 0
        ):
            raise OptionError(
                f"KernelConfig.prefill_chunk must be a multiple of 16 (16, 32, ..., 2048), got "
                f"{self.prefill_chunk!r}."
            )
        if not isinstance(self.invariant, bool):
            raise OptionError(f"KernelConfig.invariant must be True or False: {self.invariant!r}.")
        if self.loop_chunk is not None and not (
            _int(self.loop_chunk) and 1 <= self.loop_chunk <= 64
        ):
            raise OptionError(
                f"KernelConfig.loop_chunk must be an integer from 1 to 64, got {self.loop_chunk!r}."
            )

    def resolve(
        self, cfg: ModelConfig, *, backend: str | None = None, sharded: bool = False
    ) -> KernelConfig:
        """This config with every ``auto`` / ``None`` filled for ``cfg`` on ``backend`` (default:
        JAX's); ``sharded``: the program's arrays span several devices (no fused kernels)."""
        if self.resolved and not sharded:
            return self
        backend = backend or jax.default_backend()
        table = DEFAULTS["gpu" if backend == "gpu" else "cpu"]
        fill = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in table and value in ("auto", None):
                value = table[f.name]
            fill[f.name] = value
        for name in ("fused_attention", "fused_linear", "fused_commit"):
            if fill[name] == "pallas" and backend != "gpu":
                raise OptionError(
                    f"KernelConfig.{name}='pallas' needs a GPU backend (this is {backend!r}); "
                    "use 'interpret' or 'auto' here."
                )
            # the explicit step runs a device's heads through the fused attention kernel; the
            # projection kernels would fuse across its reductions, and commits run outside it
            local = name == "fused_attention" and fill["tensor_parallel"] == "shard_map"
            if sharded and not local:
                fill[name] = "off"
        if fill["quant_matmul"] == "pallas" and backend != "gpu":
            raise OptionError(
                f"KernelConfig.quant_matmul='pallas' needs a GPU backend (this is {backend!r}); "
                "use 'interpret', 'xla' or 'auto' here."
            )
        if sharded and fill["quant_matmul"] != "xla":  # the kernel has no partitioning rule
            fill["quant_matmul"] = "xla"
        if fill["attention"] == "pallas" and backend != "gpu":
            raise OptionError(
                f"KernelConfig.attention='pallas' needs a GPU backend (this is {backend!r}); use "
                "'interpret', 'reference' or 'auto' here."
            )
        if fill["prefill_attention"] == "cudnn" and backend != "gpu":
            raise OptionError(
                f"KernelConfig.prefill_attention='cudnn' needs a GPU backend (this is "
                f"{backend!r}); use 'xla', 'off' or 'auto' here."
            )
        if sharded or (fill["prefill_attention"] == "cudnn" and not _cudnn_flash()):
            # cuDNN's call is kept to one device's program (no sharded run was measured)
            fill["prefill_attention"] = "off"
        if fill["all_reduce"] == "oneshot" and backend != "gpu":
            raise OptionError(
                f"KernelConfig.all_reduce='oneshot' is a GPU kernel (this is {backend!r}); use "
                "'oneshot_reference' (the same algorithm in jax.lax), 'psum' or 'auto' here."
            )
        if fill["invariant"]:  # exact reductions in jnp: no kernel has them (model/exact.py)
            fill.update(fused_attention="off", fused_linear="off", fused_commit="off")
            fill.update(attention="reference", prefill_attention="off", gemm_rows=0)
            # the explicit step's reductions sum rounded float partials; the partitioner splits
            # the exact integer sums themselves, which stay exact
            fill.update(tensor_parallel="gspmd")
        if fill["fused_linear"] != "off" and _linear_unfit(cfg, fill["linear_tile"]):
            fill["fused_linear"] = "off"
        if fill["fused_linear"] != "off" and fill["linear_tile"] is None:
            fill["linear_tile"] = DEFAULTS["gpu"]["linear_tile"]
        fill["resolved"] = True
        return KernelConfig(**fill)

    def prefill_tokens(self, batch: int, dtype=None) -> int:
        """Prompt tokens a row per prefill step for ``batch`` rows of a model computing in
        ``dtype`` (None: any; a float32 model's first chunk cannot take cuDNN, and the flash
        kernel over a cache is slower with longer chunks)."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        per_row = 1 << (max(1, GPU_PREFILL_TOKENS // max(batch, 1)).bit_length() - 1)
        cudnn = self.prefill_attention == "cudnn" and (dtype is None or _half(dtype))
        most = CUDNN_PREFILL_CHUNK if cudnn else GPU_PREFILL_CHUNK
        return max(MIN_PREFILL_CHUNK, min(most, per_row))

    def loop_steps(self, default: int) -> int:
        """Loop iterations per check of the stop condition: the config's, else ``default`` (the
        engine's choice for a GPU)."""
        return self.loop_chunk if self.loop_chunk is not None else default

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelConfig:
        """The config the ``JAXSPEC_*`` variables set (unset ones: ``auto``). Only the CLI and
        the benchmark scripts call this; a bad value is an ``OptionError`` naming the
        variable and its choices."""
        env = os.environ if environ is None else environ
        kw = {}
        for var, (field, kind) in ENV.items():
            raw = env.get(var, "").strip()
            if raw:
                kw[field] = _env_value(var, field, kind, raw)
        for field, names, default in TILE_ENV:
            raw = [env.get(v, "").strip() for v in names]
            if any(raw):
                default = default or DEFAULTS["gpu"][field]
                kw[field] = tuple(
                    _env_value(v, field, "int", r) if r else d
                    for v, r, d in zip(names, raw, default, strict=True)
                )
                _checked("/".join(names), **{field: kw[field]})
        return cls(**kw)

    def compiler_options(self) -> dict:
        """XLA options a program with these kernels is compiled with. Invariant numerics forbid
        excess precision (XLA may otherwise skip the rounding of a bf16 intermediate inside a
        fusion, so a value's bits would depend on how its program was fused) and, on a GPU, GEMM
        autotuning (another process could time another kernel faster for the same shape). Not
        XLA's deterministic ops: every scatter here sets distinct slots, deterministic anyway,
        and the rewrite those ops apply to scatters (jax 0.11.2, H200) lost a drop-mode
        scatter's update, so a tree verify emitted its root token for an accepted child
        (``benchmarks/notes/bit_exact.md``; ``tests/test_bit_exact.py`` keeps the pattern).

        On a GPU the loops run in command buffers (``COMMAND_BUFFER``): the invariant GEMMs
        go a tile at a time through a ``while`` loop per projection, which XLA otherwise drives
        from the host (a copy of its condition and a wait per iteration). On an H200 (random
        weights, bf16, 32 new tokens, 5c995e7) that took autoregressive decoding from 63 to 183
        tok/s on the SmolLM2 shape at batch 1 and from 225 to 386 at batch 16, chain + prompt
        lookup from 464 to 900 at batch 1, and the 1B shape from 106 to 140 (batch 1) and 246
        to 321 (batch 16), with the same tokens; compiles took 10-35% less. Launching differs,
        the kernels do not: numerics are unchanged (the CPU ignores the option)."""
        if not self.invariant:
            return {}
        return {
            "xla_allow_excess_precision": False,
            "xla_gpu_autotune_level": 0,
            "xla_gpu_enable_command_buffer": COMMAND_BUFFER,
        }

    def describe(self) -> dict:
        """The settings as a plain dict (benchmarks record it beside their figures)."""
        d = dataclasses.asdict(self)
        d.pop("resolved")
        return d


# variable -> (field, choices or "int")
ENV = {
    "JAXSPEC_ATTENTION": ("attention", (*ATTENTION, "pallas_interpret")),
    "JAXSPEC_PREFILL_ATTENTION": ("prefill_attention", PREFILL_ATTENTION),
    "JAXSPEC_FUSED_ATTENTION": ("fused_attention", FUSED),
    "JAXSPEC_FUSED_LINEAR": ("fused_linear", FUSED),
    "JAXSPEC_LINEAR_ROWS": ("linear_rows", "int"),
    "JAXSPEC_FUSED_COMMIT": ("fused_commit", FUSED),
    "JAXSPEC_QUANT_MATMUL": ("quant_matmul", QUANT),
    "JAXSPEC_ROW_PADDING": ("row_padding", PADDING),
    "JAXSPEC_MIN_GEMM_ROWS": ("gemm_rows", "int"),
    "JAXSPEC_PREFILL_CHUNK": ("prefill_chunk", "int"),
    "JAXSPEC_LOOP_CHUNK": ("loop_chunk", "int"),
    "JAXSPEC_TENSOR_PARALLEL": ("tensor_parallel", TENSOR_PARALLEL),
    "JAXSPEC_ALL_REDUCE": ("all_reduce", ALL_REDUCE),
}


# variables of a tile -> (field, variables, defaults where one is unset)
TILE_ENV = (
    ("linear_tile", tuple(f"JAXSPEC_FUSED_{n}" for n in ("BN", "BK", "WARPS", "QKV_BK")), None),
    (
        "attention_tile",
        tuple(f"JAXSPEC_ATTN_{n}" for n in ("BLOCK_K", "STAGES", "MIN_SPLIT", "WARPS")),
        (None,) * 4,
    ),
    (
        "quant_tile",
        tuple(f"JAXSPEC_QUANT_{n}" for n in ("BN", "BK", "SPLITS", "WARPS", "STAGES")),
        (None,) * 5,
    ),
)


def _env_value(var: str, field: str, kind, raw: str):
    """One variable's value, checked as its field (the error names the variable)."""
    if kind == "int":
        if not raw.isdigit():
            raise OptionError(
                f"{var} must be a non-negative integer, got {raw!r}; unset it for the default."
            )
        value = int(raw)
    else:
        if raw not in kind:
            raise OptionError(
                f"{var} must be one of {', '.join(kind)}; got {raw!r}. Set it to one of those, "
                "or unset it for the default."
            )
        value = "interpret" if raw == "pallas_interpret" else raw
    if field not in ("linear_tile", "attention_tile", "quant_tile"):
        _checked(var, **{field: value})
    return value


def _checked(var: str, **field) -> None:
    try:
        KernelConfig(**field)
    except OptionError as e:
        raise OptionError(f"{var}: {e} Unset it for the default.") from None


def _cudnn_flash() -> bool:
    """Whether this machine's GPUs have cuDNN's flash attention (Ampere, sm_80, or newer). True
    where JAX sees no GPU: a config resolved for a GPU elsewhere (tests) keeps the table's."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return True
    return all(float(getattr(d, "compute_capability", "8.0")) >= 8.0 for d in gpus)


def _half(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _positive(x) -> bool:
    return _int(x) and x >= 1


def _pow2(x) -> bool:
    return _int(x) and x >= 16 and not x & (x - 1)


def _check_quant_tile(tile) -> None:
    if len(tile) != 5:
        raise OptionError(
            f"KernelConfig.quant_tile is (BN, BK, splits, warps, stages); got {tile!r}."
        )
    bn, bk, *counts = tile
    for what, v in (("BN", bn), ("BK", bk)):
        if v is not None and not _pow2(v):
            raise OptionError(f"quant_tile's {what} must be a power of two >= 16, got {v!r}.")
    for what, v in zip(("splits", "warps", "stages"), counts, strict=True):
        if v is not None and not _positive(v):
            raise OptionError(f"quant_tile's {what} must be positive, got {v!r}.")


def linear_fits(cfg: ModelConfig) -> bool:
    """Whether this model's layers take the split-K projection kernels on a GPU by default."""
    return not _linear_unfit(cfg, DEFAULTS["gpu"]["linear_tile"])


def _linear_unfit(cfg: ModelConfig, tile) -> bool:
    """Layers the split-K projection kernels should not take: biased projections, and sizes whose
    norm programs would re-read too many partials (``fused_linear.layer_problem``)."""
    bk = None if tile is None else tile[1]
    width = cfg.num_heads * cfg.head_dim
    problem = fused_linear.layer_problem(cfg.hidden_size, width, cfg.intermediate_size, bk)
    return cfg.qkv_bias or problem is not None
