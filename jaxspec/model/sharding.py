"""Meshes and tensor-parallel parameter layouts.

One small table of logical rules says which dimension of each parameter is split over the mesh
axis named ``"tp"`` (Megatron layout: column-parallel q/k/v/gate/up, row-parallel o/down, the
vocabulary split in the embedding rows and the lm_head columns). Every other parameter is
replicated, and every other mesh axis replicates the parameters.

A quantized weight (``pallas_kernels.quant``) has the axes of the matrix it stands for on each
of its arrays: its codes ``[K or K/2, N]`` and its scales and mins ``[K / group, N]`` split
alike, so a shard holds whole groups with their scales (4-bit codes pack rows within a group, so
packed rows split at group boundaries too). Where the groups do not split evenly (fewer groups
than devices: a scale per output channel), K stays whole. A quantized embedding is stored as the
LM head, ``[D, V]``: the vocabulary is its second axis.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxspec.config import ModelConfig
from jaxspec.errors import DeviceError
from jaxspec.model import tensor_parallel
from jaxspec.model.quantized import any_quantized
from jaxspec.model.transformer import Model, param_shapes, with_params
from pallas_kernels import quant, quant_wgmma
from pallas_kernels.pytree import build

TP = tensor_parallel.AXIS

# Logical axis names per parameter (by the last two path parts: module, leaf), for [in, out]
# kernels, [V, D] embeddings and 1-D biases / norm weights. None: not split.
_PARAM_AXES: dict[tuple[str, str], tuple[str | None, ...]] = {
    ("q_proj", "kernel"): (None, "heads"),
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "kernel"): (None, "kv_heads"),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "kernel"): (None, "kv_heads"),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("heads", None),
    ("gate_proj", "kernel"): (None, "mlp"),
    ("up_proj", "kernel"): (None, "mlp"),
    ("down_proj", "kernel"): ("mlp", None),
    ("lm_head", "kernel"): (None, "vocab"),
    ("", "embed_tokens"): ("vocab", None),
}
# Logical axis -> mesh axis.
LOGICAL_RULES: dict[str, str] = {"heads": TP, "kv_heads": TP, "mlp": TP, "vocab": TP}


def tp_degree(mesh: Mesh) -> int:
    return int(dict(mesh.shape).get(TP, 1))


def _split_sizes(cfg: ModelConfig) -> dict[str, int]:
    return {
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
    }


def valid_tp_degrees(cfg: ModelConfig, limit: int | None = None) -> list[int]:
    """Tensor-parallel degrees that divide every split dimension (up to ``limit``)."""
    g = math.gcd(*_split_sizes(cfg).values())
    return [d for d in range(1, g + 1) if g % d == 0 and (limit is None or d <= limit)]


def check_tp(cfg: ModelConfig, degree: int) -> None:
    """Raise DeviceError unless ``degree`` divides heads, kv heads, MLP width and vocabulary."""
    bad = {k: v for k, v in _split_sizes(cfg).items() if v % degree}
    if bad:
        what = ", ".join(f"{k}={v}" for k, v in bad.items())
        ok = valid_tp_degrees(cfg, limit=max(degree, len(jax.devices())))
        raise DeviceError(
            f"a tensor-parallel degree of {degree} (mesh axis {TP!r}) does not divide {what}; "
            f"use a mesh whose {TP!r} axis has size {' or '.join(map(str, ok))}."
        )


def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis in Auto (GSPMD-propagated) mode.

    ``jax.make_mesh`` makes Explicit axes by default; the model's forward is written for
    sharding propagation (its gathers and contractions over split axes need no annotations),
    so parameters are placed on the Auto twin of the caller's mesh.
    """
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def partition_spec(path: tuple, ndim: int) -> PartitionSpec:
    """The PartitionSpec of the parameter at ``path`` (keys as in ``weights.hf_to_tree``)."""
    names = tuple(str(k) for k in path)
    key = ("", names[0]) if len(names) == 1 else names[-2:]
    axes = _PARAM_AXES.get(key)
    if axes is None or len(axes) != ndim:
        return PartitionSpec()
    return PartitionSpec(*(None if a is None else LOGICAL_RULES[a] for a in axes))


def _layout(cfg: ModelConfig) -> dict:
    """Nested dict (as ``hf_to_tree`` / ``nnx.to_pure_dict``) of parameter ranks."""
    tree: dict = {}
    for path, shape in param_shapes(cfg).items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = len(shape)
    return tree


def _quantized_matrix_spec(path: tuple, k: int, group: int, degree: int) -> PartitionSpec:
    """The ``[K, N]`` rule of a quantized weight at ``path``: K split only at group boundaries."""
    names = tuple(str(x) for x in path)
    if names == ("embed_tokens",):  # stored as the LM head: [D, V]
        names = ("lm_head", "kernel")
    spec = partition_spec(names, 2)
    if spec and spec[0] is not None and (k // group) % degree:
        spec = PartitionSpec(None, spec[1])
    return spec


def quantized_spec(path: tuple, w: quant.QuantizedWeight, degree: int):
    """The PartitionSpecs of a quantized weight's arrays (a ``QuantizedWeight`` of them)."""
    spec = _quantized_matrix_spec(path, w.shape[0], w.group, degree)
    return jax.tree.map(lambda _: spec, w)


def kmajor_spec(path: tuple, w: quant_wgmma.KMajorWeight, degree: int):
    """The PartitionSpecs of a weight laid out K-major for Hopper's kernel (a ``KMajorWeight``
    of them): the stored layout's rule with its codes' axes swapped (``values [N, K]``), scales
    ``[K/group, N]`` as the stored ones. Such a program runs the XLA path (the kernel has no
    partitioning rule), which dequantizes each device's shard."""
    spec = _quantized_matrix_spec(path, w.shape[0], w.group, degree)
    k_axis, n_axis = (tuple(spec) + (None, None))[:2]
    return build(
        quant_wgmma.KMajorWeight, values=PartitionSpec(n_axis, k_axis),
        scales=PartitionSpec(k_axis, n_axis), bits=w.bits, group=w.group, dtype=w.dtype,
    )  # fmt: skip


def param_partition_specs(cfg: ModelConfig, params: dict | None = None, degree: int = 1) -> dict:
    """Nested dict of PartitionSpecs over the mesh axis ``"tp"`` for the parameters of ``cfg``,
    or of the nested parameter dict ``params`` (quantized weights' arrays included, laid out for
    ``degree`` devices)."""
    if params is None:
        return jax.tree_util.tree_map_with_path(
            lambda p, ndim: partition_spec(tuple(_key(k) for k in p), ndim), _layout(cfg)
        )

    def one(p, x):
        path = tuple(_key(k) for k in p)
        if quant.is_quantized(x):
            return quantized_spec(path, x, degree)
        if isinstance(x, quant_wgmma.KMajorWeight):
            return kmajor_spec(path, x, degree)
        return partition_spec(path, len(x.shape))

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=any_quantized)


def param_specs(cfg: ModelConfig, mesh: Mesh, params: dict | None = None) -> dict:
    """Nested dict of NamedShardings for every parameter on ``mesh`` (checked for ``cfg``); with
    ``params`` (a nested parameter dict, arrays or abstract), for those, quantized weights'
    arrays included.

    Raises DeviceError when the mesh's ``"tp"`` size does not divide the split dimensions.
    """
    check_tp(cfg, tp_degree(mesh))
    mesh = auto_mesh(mesh)
    specs = param_partition_specs(cfg, params, tp_degree(mesh))
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def _key(k) -> object:
    return getattr(k, "key", getattr(k, "idx", k))


def tp_mesh(devices) -> Mesh:
    """A 1-D tensor-parallel mesh (axis ``"tp"``, Auto) over ``devices``, which may belong to
    several processes (``jax.devices()`` of a distributed job lists all of them)."""
    devices = list(devices)
    return jax.make_mesh((len(devices),), (TP,), devices=devices, axis_types=(AxisType.Auto,))


def place(model: Model, devices) -> tuple[Model, NamedSharding]:
    """``model`` with its weights on a 1-D tensor-parallel mesh over ``devices`` (kept with the
    model for the next call), and the replicated sharding of that mesh (for small inputs).

    Weights already laid out so stay where they are. Across processes, each process places its
    own shards from its whole copy (a model built, or loaded with ``mesh=None``, in every
    process); weights split over other processes' devices cannot be moved this way."""
    key = ("placed", tuple(devices))
    got = model._cache.get(key)
    if got is None:
        mesh = tp_mesh(devices)
        pure = nnx.to_pure_dict(model.params)
        specs = param_specs(model.config, mesh, pure)
        state = jax.tree.map(lambda x: x, model.params)
        nnx.replace_by_pure_dict(state, jax.tree.map(_put, pure, specs))
        got = model._cache[key] = (with_params(model, state), NamedSharding(mesh, PartitionSpec()))
    return got


def _put(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    if x.sharding == sharding or (x.is_fully_addressable and sharding.is_fully_addressable):
        return jax.device_put(x, sharding)
    if not x.is_fully_addressable:
        raise DeviceError(
            f"the weights lie on {len(x.sharding.device_set)} devices, some in other processes, "
            f"and {sharding.num_devices} others were asked for; across processes load each model "
            "onto the mesh it runs on (jaxspec.load(path, mesh=...)), or whole in every process "
            "(mesh=None) and let the engine place it."
        )
    return jax.device_put(np.asarray(x), sharding)  # each process puts its own shards
