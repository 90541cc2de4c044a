"""SwiftSpec: asynchronous, disaggregated tree speculation over two device meshes."""

from jaxspec.engines.swiftspec.engine import OPTIONS, run

__all__ = ["OPTIONS", "run"]
