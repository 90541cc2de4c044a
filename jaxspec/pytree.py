"""``pytree_dataclass`` (defined beside the kernels, which take such dataclasses too: a quantized
weight is one; see ``pallas_kernels.pytree``)."""

from pallas_kernels.pytree import pytree_dataclass

__all__ = ["pytree_dataclass"]
