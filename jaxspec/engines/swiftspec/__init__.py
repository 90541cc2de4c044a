"""SwiftSpec: asynchronous, disaggregated tree speculation over two device meshes (``engine``),
its workers (``workers``) and their two loops (``threads``, ``device``)."""
