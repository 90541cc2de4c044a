"""``pytree_dataclass``: a dataclass registered as a JAX pytree (here, the lowest layer, so that the
kernels and the library share it; ``jaxspec.pytree`` re-exports it).

Like ``jax.tree_util.register_dataclass``, but unflattening rebuilds the object without calling
``__init__``: JAX unflattens with placeholders (abstract values, donation info) that are not
arrays, while explicit construction keeps its runtime shape checks. Fields with
``metadata={"static": True}`` are static (part of the tree structure).
"""

from __future__ import annotations

import dataclasses

import jax


def pytree_dataclass(cls):
    cls = dataclasses.dataclass(cls)
    fields = dataclasses.fields(cls)
    data = tuple(f.name for f in fields if not f.metadata.get("static"))
    meta = tuple(f.name for f in fields if f.metadata.get("static"))

    def flatten_with_keys(x):
        children = tuple((jax.tree_util.GetAttrKey(n), getattr(x, n)) for n in data)
        return children, tuple(getattr(x, n) for n in meta)

    def flatten(x):
        return tuple(getattr(x, n) for n in data), tuple(getattr(x, n) for n in meta)

    def unflatten(aux, children):
        return build(
            cls, **dict(zip(data, children, strict=True)), **dict(zip(meta, aux, strict=True))
        )

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


def build(cls, **fields):
    """An instance of the pytree dataclass ``cls`` with these fields, built without ``__init__``
    (its checks): for placeholders such as ``jax.ShapeDtypeStruct`` leaves."""
    obj = object.__new__(cls)
    for n, v in fields.items():
        object.__setattr__(obj, n, v)
    return obj
