"""Quantized models: which weights quantize, their formats as a small table (``formats``: what
a checkpoint's config.json records and ``load`` rebuilds its restore template from), and a
model's quantized or dequantized twin.

A quantized parameter is a ``QuantizedWeight`` (``pallas_kernels.quant``) where the float model
has an array: the projections' ``[in, out]`` kernels, the LM head, and a quantized embedding,
which is stored as the LM head it also is when tied, ``[D, V]`` (``layers.embed_rows`` reads its
columns). The NNX graph is the float model's; only the parameter state differs, so every engine
runs a quantized model through the same forward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import kernels as K
from jaxspec.config import ModelConfig
from jaxspec.errors import OptionError
from jaxspec.model.transformer import Model, abstract_model, with_params
from pallas_kernels import quant, quant_wgmma
from pallas_kernels.quant import QuantizedWeight

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EMBEDDING = ("embed_tokens",)
HEAD = ("lm_head", "kernel")


def path_name(path: tuple) -> str:
    """``("layers", 0, "mlp", "up_proj", "kernel")`` -> ``"layers.0.mlp.up_proj.kernel"``."""
    return ".".join(str(k) for k in path)


def name_path(name: str) -> tuple:
    return tuple(int(k) if k.isdigit() else k for k in name.split("."))


def quantizable(path: tuple, cfg: ModelConfig) -> bool:
    """Whether ``quantize_params`` quantizes the parameter at ``path``: the projections, the LM
    head, and the embedding when it is the LM head too (tied); an untied embedding is read a
    row per token, so quantizing it saves memory but no time."""
    if path == HEAD or (path == EMBEDDING and cfg.tie_word_embeddings):
        return True
    return len(path) >= 2 and path[-1] == "kernel" and path[-2] in LINEARS


def format_of(w: QuantizedWeight) -> dict:
    """A weight's format, as ``formats`` records it."""
    return {
        "bits": w.bits,
        "group": w.group,
        "scales": jnp.dtype(w.scales.dtype).name,
        "mins": None if w.mins is None else jnp.dtype(w.mins.dtype).name,
    }


def _walk(pure, fn, path=()):
    """``pure`` (a nested parameter dict) with ``fn(path, leaf)`` at every leaf, a
    ``QuantizedWeight`` counting as one leaf."""
    if isinstance(pure, dict):
        return {k: _walk(v, fn, (*path, k)) for k, v in pure.items()}
    return fn(path, pure)


def formats(pure: dict) -> dict[str, dict]:
    """``{path name: format}`` of the quantized weights of a nested parameter dict."""
    found = {}

    def note(path, x):
        if quant.is_quantized(x):
            found[path_name(path)] = format_of(x)

    _walk(pure, note)
    return found


def check_group(name: str, k: int, bits: int, group: int | None) -> None:
    """OptionError unless ``group`` rows divide the ``k`` rows of weight ``name``."""
    problem = quant.group_problem(bits, group or k, k)
    if problem:
        ok = [g for g in (32, 64, 128, 256) if not quant.group_problem(bits, g, k)]
        raise OptionError(
            f"group_size {group} does not divide the {k} input rows of {name} ({problem}); "
            f"use a group size that divides every layer's input width"
            + (f", such as {' or '.join(map(str, ok))}." if ok else ".")
        )


def quantize_array(
    name: str, w, bits: int, group: int | None, transpose: bool = False, scale_dtype=jnp.float32
):
    """One float parameter quantized (``transpose``: an embedding ``[V, D]``, quantized as the
    LM head ``[D, V]``), its scales in ``scale_dtype``."""
    w = jnp.asarray(w)
    w = w.T if transpose else w
    check_group(name, w.shape[0], bits, group)
    return quant.quantize(w, bits, group, scale_dtype=scale_dtype)


def quantize_params(pure: dict, cfg: ModelConfig, bits: int, group: int | None = None) -> dict:
    """A nested float parameter dict with every ``quantizable`` weight quantized (symmetric;
    ``group`` rows a scale, None: a scale per output channel)."""

    def one(path, x):
        if quant.is_quantized(x) or not quantizable(path, cfg):
            return x
        return quantize_array(path_name(path), x, bits, group, transpose=path == EMBEDDING)

    return _walk(pure, one)


def dequantize_params(pure: dict, dtype=None) -> dict:
    """A nested parameter dict with every ``QuantizedWeight`` dequantized (in ``dtype``, default
    its own), an embedding back to ``[V, D]``."""

    def one(path, x):
        if isinstance(x, quant_wgmma.KMajorWeight):
            return quant_wgmma.dequantize(x, dtype)
        if not quant.is_quantized(x):
            return x
        w = _DEQUANTIZE(x, None if dtype is None else jnp.dtype(dtype))
        return w.T if path == EMBEDDING else w

    return _walk(pure, one)


# one program per weight shape and format: op by op, the default model's 211 quantized weights
# dispatched ~2,100 small programs (2.1 s of a 9 s warm `jaxspec generate` on the 2-core CPU).
# Compiled, ``q * s + m`` may become one FMA; the formats' products are exact in float32 (see
# ``pallas_kernels.quant``), so the result is the same bit for bit.
_DEQUANTIZE = jax.jit(quant.dequantize, static_argnums=1)


def _with_pure(model: Model, pure: dict, **changes) -> Model:
    state = jax.tree.map(lambda x: x, model.params)
    nnx.replace_by_pure_dict(state, pure)
    return with_params(model, state, **changes)


def quantize_model(model: Model, bits: int, group: int | None = None) -> Model:
    """``model`` with its projections and LM head quantized (``quantize_params``)."""
    pure = quantize_params(nnx.to_pure_dict(model.params), model.config, bits, group)
    return _with_pure(model, pure, name=f"{model.name}-int{bits}")


def dequantize_model(model: Model, dtype=None) -> Model:
    """``model`` with every quantized weight dequantized (the float model it stands for)."""
    return _with_pure(model, dequantize_params(nnx.to_pure_dict(model.params), dtype))


def any_quantized(x) -> bool:
    """A weight kept quantized: stored (``QuantizedWeight``) or laid out K-major."""
    return quant.is_quantized(x) or isinstance(x, quant_wgmma.KMajorWeight)


def is_quantized_model(model: Model) -> bool:
    return any(any_quantized(x) for x in _leaves(nnx.to_pure_dict(model.params)))


def _leaves(pure):
    return jax.tree.leaves(pure, is_leaf=any_quantized)


def kmajor_model(model: Model) -> Model:
    """``model`` with every quantized projection and LM head that ``quant_wgmma`` can lay out
    (symmetric, no mins; groups of a whole number of its K steps: per-channel int8, int4 in
    groups of 128) in its K-major layout (``quant_wgmma.prepare``, once); the rest as it is. Its
    programs dequantize the laid-out weights exactly as the stored ones (``quant_wgmma
    .dequantize``) wherever the WGMMA kernel does not run."""

    def one(path, x):
        if not quant.is_quantized(x) or path == EMBEDDING or quant_wgmma.unsupported_weight(x):
            return x
        return quant_wgmma.prepare(x)

    return _with_pure(model, _walk(nnx.to_pure_dict(model.params), one))


def wgmma_takes(cfg: ModelConfig, dtype, fmts: dict[str, dict], device=None) -> bool:
    """Whether ``for_wgmma`` would lay out any weight of a checkpoint of these quantized
    ``formats`` loaded in ``dtype`` (the weights' shapes aside: one whose N is not a multiple of
    64 stays as stored)."""
    half = jnp.dtype(dtype) in quant_wgmma.HALF
    if not half or not quant_wgmma.device_supported(device) or K.linear_fits(cfg):
        return False
    return any(
        f["mins"] is None and f["group"] % quant_wgmma.BK[f["bits"]] == 0
        for name, f in fmts.items()
        if name_path(name) != EMBEDDING
    )


def for_wgmma(model: Model, device=None) -> Model:
    """``kmajor_model(model)`` where Hopper's WGMMA kernel would run it: an sm_90 GPU
    (``device``, default JAX's first), bf16/f16 compute, and layers that do not take the fused
    split-K kernels (those take ``QuantizedWeight``: small models, ``kernels.linear_fits``);
    elsewhere ``model`` itself. ``load`` lays out for one device only; a laid-out model placed
    on a mesh keeps the layout, split by ``sharding.kmajor_spec``, and runs the XLA path there.
    Never saved (checkpoints keep the stored layout)."""
    half = jnp.dtype(model.dtype) in quant_wgmma.HALF
    if not half or not quant_wgmma.device_supported(device) or K.linear_fits(model.config):
        return model
    return kmajor_model(model)


def abstract_params(cfg: ModelConfig, dtype, fmts: dict[str, dict]):
    """(graphdef, abstract parameter state) of a model whose weights in ``fmts`` are quantized:
    the restore template of ``load``."""
    graphdef, state = abstract_model(cfg, dtype)
    pure = nnx.to_pure_dict(state)
    for name, f in fmts.items():
        path = name_path(name)
        node = pure
        for key in path[:-1]:
            node = node[key]
        shape = node[path[-1]].shape
        k, n = shape[::-1] if path == EMBEDDING else shape
        node[path[-1]] = QuantizedWeight.abstract(
            f["bits"], f["group"], dtype, k, n, f["scales"], f["mins"]
        )
    nnx.replace_by_pure_dict(state, pure)
    return graphdef, state


def storable(pure: dict) -> dict:
    """The nested dict Orbax stores: each ``QuantizedWeight`` as a dict of its arrays (its
    format goes to config.json: ``formats``)."""

    def one(_, x):
        if not quant.is_quantized(x):
            return x
        out = {"values": x.values, "scales": x.scales}
        return out if x.mins is None else {**out, "mins": x.mins}

    return _walk(pure, one)


def from_storable(stored: dict, template: dict) -> dict:
    """``storable``'s inverse: the arrays Orbax restored (``stored``) in the structure of
    ``template`` (a nested dict whose quantized weights are ``QuantizedWeight`` placeholders)."""

    def one(path, t):
        node = stored
        for key in path:
            node = node[key]
        if not quant.is_quantized(t):
            return node
        return dataclasses.replace(
            t, values=node["values"], scales=node["scales"], mins=node.get("mins")
        )

    return _walk(template, one)
