"""The decoding methods, one engine each, in ``ENGINES`` (see ``engines.base`` for the
interface)."""

from jaxspec.engines import (  # noqa: F401  (register in this order)
    autoregressive,
    chain,
    magicdec,  # noqa: F401, I001
    tree,
)
from jaxspec.engines.base import ENGINES, Engine
from jaxspec.engines.swiftspec import engine as swiftspec  # noqa: F401

__all__ = ["ENGINES", "Engine"]
