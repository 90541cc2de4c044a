"""Pieces every engine shares: padded prompt batches, chunked prefill, EOS bookkeeping,
compilation caching and the result type."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxspec.kernels import fused_kernels_for
from jaxspec.model.kv_cache import KVCache, causal_block
from jaxspec.model.transformer import apply

# Prompt tokens per row and prefill step: JAXSPEC_PREFILL_CHUNK, else PREFILL_CHUNK off GPU. On a
# GPU the chunk's attention is the flash kernel (pallas_kernels/prefill_attention.py), and wider
# chunks mean fewer, fuller GEMMs: at 4096 prompt tokens of the SmolLM2 shape, 256-token chunks
# took 43.4 ms, 1024 15.9, 2048 14.0, 4096 15.3 (benchmarks/notes/prefill_probe.md). So
# GPU_PREFILL_TOKENS rows x tokens per step, 2048 tokens a row at most, PREFILL_CHUNK at least.
PREFILL_CHUNK = 256
PREFILL_CHUNK_ENV = "JAXSPEC_PREFILL_CHUNK"
GPU_PREFILL_TOKENS = 16384
GPU_PREFILL_CHUNK = 2048
LOOP_CHUNK_ENV = "JAXSPEC_LOOP_CHUNK"


@dataclasses.dataclass
class GenerationResult:
    """New tokens per prompt (stopping at EOS, kept, or max_new_tokens), their text when the
    model has a tokenizer, and run statistics (wall_s, tokens_per_s, acceptance_length, ...)."""

    tokens: list[list[int]]
    text: list[str] | None
    stats: dict[str, Any]


def prefill_chunk(batch: int = 1) -> int:
    """The prefill chunk for ``batch`` rows: ``JAXSPEC_PREFILL_CHUNK`` (a multiple of 16) when
    set, else the backend's default (see ``GPU_PREFILL_TOKENS``)."""
    from jaxspec.errors import OptionError

    raw = os.environ.get(PREFILL_CHUNK_ENV, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 16 or int(raw) % 16:
            raise OptionError(
                f"{PREFILL_CHUNK_ENV} must be a multiple of 16 (16, 32, ..., 2048), got {raw!r}; "
                "unset it for the default."
            )
        return int(raw)
    if jax.default_backend() != "gpu":
        return PREFILL_CHUNK
    per_row = 1 << (max(1, GPU_PREFILL_TOKENS // max(batch, 1)).bit_length() - 1)
    return max(PREFILL_CHUNK, min(GPU_PREFILL_CHUNK, per_row))


def fit_chunk(width: int, chunk: int) -> int:
    """The widest step of at most ``chunk`` tokens that divides ``width`` (the whole width
    when it fits in one): prompts padded for another chunk still prefill every token."""
    if width <= chunk:
        return width
    step = 16 if width % 16 == 0 else 1
    c = chunk - chunk % step
    while width % c:
        c -= step
    return c


def pad_prompts(prompts: list[list[int]]):
    """Right-pad: ids [B, L], lengths [B]. L is a multiple of 16 up to one prefill chunk, then of
    the chunk (few distinct shapes, so few compiles)."""
    lens = np.array([len(p) for p in prompts], np.int32)
    chunk = prefill_chunk(len(prompts))
    multiple = 16 if lens.max() <= chunk else chunk
    width = int(-(-lens.max() // multiple) * multiple)
    ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return jnp.asarray(ids), jnp.asarray(lens)


def prefill(
    graphdef,
    params,
    cache: KVCache,
    ids: Int[Array, "b l"],
    lens: Int[Array, " b"],
    *,
    vocab: int,
    chunk: int | None = None,
) -> tuple[Float[Array, "b v"], KVCache]:
    """Feed each row's prompt in chunks (one compiled body, ``lax.fori_loop``); return the logits
    after each row's last prompt token and the cache with the prompt committed. ``chunk``
    (default ``prefill_chunk(batch)``) is cut down to divide the width (``fit_chunk``).

    Positions equal slots here (a dense cache); ragged rows simply stop earlier.
    """
    b, width = ids.shape
    chunk = fit_chunk(width, chunk or prefill_chunk(b))

    def body(c, carry):
        cache, last = carry
        start = c * chunk
        valid = jnp.clip(lens - start, 0, chunk)
        tok = jax.lax.dynamic_slice_in_dim(ids, start, chunk, axis=1)
        block = causal_block(cache.length, cache.length, valid, chunk)
        select = jnp.clip(valid - 1, 0, chunk - 1)[:, None]
        logits, cache = apply(graphdef, params, tok, cache, block, select)
        ends_here = (valid > 0) & (lens <= start + chunk)
        last = jnp.where(ends_here[:, None], logits[:, 0], last)
        cache.length = cache.length + valid
        return cache, last

    last0 = jnp.zeros((b, vocab), jnp.float32)
    cache, last = jax.lax.fori_loop(0, width // chunk, body, (cache, last0))
    return last, cache


def is_eos(tok: Int[Array, "*b"], eos_ids: tuple[int, ...]) -> Bool[Array, "*b"]:
    if not eos_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.isin(tok, jnp.asarray(eos_ids, jnp.int32))


def loop_chunk(gpu_default: int) -> int:
    """Loop iterations per check of the stop condition: ``gpu_default`` on GPU, 1 elsewhere
    (where the check is cheap and iterations after the last row is done are pure waste);
    ``JAXSPEC_LOOP_CHUNK`` overrides both (for measuring, and for the tests)."""
    from jaxspec.errors import OptionError

    raw = os.environ.get(LOOP_CHUNK_ENV, "").strip()
    if raw:
        if not raw.isdigit() or not 1 <= int(raw) <= 64:
            raise OptionError(f"{LOOP_CHUNK_ENV} must be an integer from 1 to 64, got {raw!r}.")
        return int(raw)
    return gpu_default if jax.default_backend() == "gpu" else 1


# verifications per check of the stop condition on GPU for speculative loops at batch <= 8, where
# a step is short (~1 ms) and the check's round trip shows; at larger batches a step is long and
# a chunk would mostly add wasted verifications at the end
SPEC_GPU_CHUNK = 4


def spec_chunk(batch: int) -> int:
    return loop_chunk(SPEC_GPU_CHUNK if batch <= 8 else 1)


def until_done(step, s, chunk: int):
    """``while not all(s.done): s = step(s)``, checking the condition every ``chunk`` iterations.

    On GPU a data-dependent ``lax.while_loop`` costs a device-to-host copy and a wait per
    iteration; a chunk pays it once per ``chunk`` steps. The steps a chunk runs after every row
    is done must change nothing (the engines mask emitting and cache growth by ``done``), and are
    not counted in ``s.steps``.
    """
    if chunk == 1:
        return jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, s)

    def one(_, s):
        active = ~jnp.all(s.done)
        s = step(s)
        s.steps = s.steps - 1 + active
        return s

    return jax.lax.while_loop(
        lambda s: ~jnp.all(s.done), lambda s: jax.lax.fori_loop(0, chunk, one, s), s
    )


def trim(out: np.ndarray, n: np.ndarray) -> list[list[int]]:
    return [[int(x) for x in row[: int(k)]] for row, k in zip(out, n, strict=True)]


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0


_COMPILED: dict = {}
_COMPILE_LOCK = threading.Lock()


def compiled(fn, *args, **static):
    """Ahead-of-time compile ``fn`` (a ``jax.jit`` with ``static`` as its static arguments) once
    per (static values, argument shapes/dtypes/shardings); returns (executable, compile seconds).

    Engines time execution apart from compilation, so tokens/s never includes a compile.
    """

    def spec(x):
        return (x.shape, x.dtype, getattr(x, "sharding", None)) if hasattr(x, "shape") else x

    leaves, treedef = jax.tree.flatten(args)
    key = (fn, tuple(sorted(static.items())), treedef, tuple(spec(x) for x in leaves))
    # one compile at a time: SwiftSpec's two worker threads compile concurrently otherwise, and
    # the engines subtract the summed compile seconds from their wall time
    with _COMPILE_LOCK:
        if key in _COMPILED:
            return _COMPILED[key], 0.0
        # sharded weights (tensor parallel, or SwiftSpec's two-device program): the fused Pallas
        # kernels (projections, attention) have no partitioning rule, so they stay out
        with fused_kernels_for(leaves), Timer() as t:
            exe = fn.lower(*args, **static).compile()
        if len(_COMPILED) > 64:
            _COMPILED.clear()
        _COMPILED[key] = exe
    return exe, t.s


def execute(fn, *args, **static):
    """Compile ``fn`` once per shapes (cached), run it, wait: (outputs, wall_s, compile_s)."""
    exe, compile_s = compiled(fn, *args, **static)
    with Timer() as t:
        out = jax.block_until_ready(exe(*args))
    return out, t.s, compile_s


def speculative_stats(steps, emitted, live_steps, *, wall_s, compile_s, draft_per_step) -> dict:
    """Stats of an on-device speculative loop: ``steps`` verifications after the prefill;
    acceptance length = tokens produced per verification of a live row."""
    return {
        "wall_s": wall_s,
        "compile_s": compile_s,
        "target_steps": int(steps) + 1,
        "draft_steps": int(steps) * draft_per_step,
        "acceptance_length": float(
            np.asarray(emitted).sum() / max(np.asarray(live_steps).sum(), 1)
        ),
    }
