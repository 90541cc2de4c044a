"""Orbax restores in a distributed job: which processes read, and the barriers they share.

Orbax's restore ends with a barrier over the processes that take part. A mesh over every
process's devices (or a whole copy in each, ``mesh=None``) has every process read; a mesh over
some processes' devices (SwiftSpec's draft on one host) has only those read, under a barrier of
their own, while the others, which hold no shard, make arrays without data.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from jaxspec import distributed


def readers(mesh: Mesh | None) -> set[int] | None:
    """The processes that read a restore onto ``mesh``; None for all of them."""
    if mesh is None or jax.process_count() == 1:
        return None
    procs = {d.process_index for d in mesh.devices.flat}
    return None if len(procs) == jax.process_count() else procs


def checkpointer(mesh: Mesh | None):
    """An Orbax checkpointer whose barriers span the processes that read ``mesh``'s shards (a
    process outside them gets one of its own, for metadata only)."""
    import orbax.checkpoint as ocp

    procs = readers(mesh)
    if procs is None:
        return ocp.StandardCheckpointer()
    me = jax.process_index()
    active = procs if me in procs else {me}
    options = ocp.options.MultiprocessingOptions(
        primary_host=min(active),
        active_processes=set(active),
        barrier_sync_key_prefix=f"jaxspec_load_{distributed.step()}",  # alike in every process
    )
    return ocp.StandardCheckpointer(multiprocessing_options=options)


def restore(ckptr, directory, target, mesh: Mesh | None):
    """``ckptr.restore(directory, target)``, or arrays without shards where this process holds
    none of ``mesh``'s devices (it reads nothing)."""
    procs = readers(mesh)
    if procs is None or jax.process_index() in procs:
        return ckptr.restore(directory, target)
    return jax.tree.map(
        lambda x: jax.make_array_from_single_device_arrays(x.shape, x.sharding, [], dtype=x.dtype),
        target,
    )
