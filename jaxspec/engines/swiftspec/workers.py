"""SwiftSpec's two workers as pure functions of one static ``Program``, and what crosses between
their meshes.

Target worker (mesh A): ``target_prefill`` (the prompt, the first token), ``target_verify`` (a
snapshot verified, committed, the verdict packed for the other mesh). Draft worker (mesh B):
``draft_init`` (its prompt cache and a one-node tree), ``draft_grow`` (n expansions: what it
does while a verify is in flight), ``draft_next`` (re-root the grown tree on a verdict, take the
next snapshot). Only token ids and a snapshot (<= bs + 1 nodes) cross, each packed into one
int32 array: one transfer per direction.

The loops (``threads``: one host thread per worker; ``device``: one program over both devices)
and SwiftSpec's split chooser (``measure.split``) run these same functions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.engines import base
from jaxspec.engines.tree import TreeShape, snapshot, verify_and_commit
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import Net
from jaxspec.pytree import pytree_dataclass
from jaxspec.spec import tree as T
from jaxspec.spec.drafts import Prefill


@pytree_dataclass
class TargetState:
    cache: KVCache
    out: base.Out
    key: jax.Array  # split on device each verify: no per-iteration key work on the host


@pytree_dataclass
class Verdict:
    """What crosses back from the target: accepted block slots, their number, the next token,
    and whether every row is done."""

    path: jax.Array
    n: jax.Array
    next: jax.Array
    done: jax.Array


def _bits(x) -> jax.Array:
    """One leaf as flat int32: integers and bools by value, 32-bit floats by their bits."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        if jnp.dtype(x.dtype).itemsize != 4:
            raise ValueError(f"pack takes 32-bit floats, got {x.dtype}")
        return jax.lax.bitcast_convert_type(x, jnp.int32).ravel()
    return jnp.ravel(x).astype(jnp.int32)


def pack(tree) -> jax.Array:
    """A pytree of integer/bool/float32 arrays as one flat int32 array: one transfer between
    meshes instead of one per leaf (each cross-device copy has a fixed latency). Floats travel
    as their bits, so ``unpack`` restores them exactly (a draft tree's scores)."""
    return jnp.concatenate([_bits(x) for x in jax.tree.leaves(tree)])


def spec(tree) -> tuple:
    """The static layout ``unpack`` needs: (treedef, ((shape, dtype), ...)); hashable."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), jnp.dtype(x.dtype).name) for x in leaves)


def unpack(flat: jax.Array, layout: tuple):
    treedef, shapes = layout
    leaves, at = [], 0
    for shape, dtype in shapes:
        size = int(np.prod(shape, dtype=np.int64))
        part = flat[at : at + size].reshape(shape)
        if jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            leaves.append(jax.lax.bitcast_convert_type(part, jnp.dtype(dtype)))
        else:
            leaves.append(part.astype(dtype))
        at += size
    return jax.tree.unflatten(treedef, leaves)


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything SwiftSpec's worker programs are compiled for (static, hashable).

    ``shape.depth`` is the tree's room (the levels a snapshot holds, those grown during its
    verify, and the extra expansions); ``d`` the expansions per verification; ``refill`` the
    most expansions to wait for before a snapshot when the bonus token missed the tree.
    ``snap_layout`` / ``verdict_layout``: how a snapshot and a verdict are packed."""

    target: Net
    draft: object  # spec.tree_drafts.ModelTreeDraft
    shape: TreeShape
    req: base.Request
    capacity: int
    d: int
    refill: int = 0
    snap_layout: tuple = ()
    verdict_layout: tuple = ()


# ---------------------------------------------------------------- target worker (mesh A)


def target_prefill(prog: Program, tflat, ids, lens, seed):
    cache, tok, out, key = base.start(
        prog.target, tflat, ids, lens, jax.random.key(seed), prog.req, prog.capacity
    )
    return TargetState(cache, out, key), tok


def target_verify(prog: Program, tflat, s: TargetState, packed):
    """Verify a snapshot (``packed``, laid out at root slot/position 0: shifted here to this
    cache's length). Returns (state, verdict, the verdict packed for the draft's mesh)."""
    snap: T.TreeBlock = unpack(packed, prog.snap_layout)
    key, sub = jax.random.split(s.key)
    block = dataclasses.replace(
        snap.block,
        positions=snap.block.positions + s.cache.length[:, None],
        slots=jnp.where(snap.valid, snap.block.slots + s.cache.length[:, None], T.NO_SLOT),
    )
    tb = dataclasses.replace(snap, block=block)
    req = prog.req
    v = verify_and_commit(prog.target, tflat, s.cache, tb, sub, s.out, req.sampling, req.eos)
    verdict = Verdict(v.path, v.n, v.next, jnp.all(v.out.done))
    return TargetState(v.cache, v.out, key), verdict, pack(verdict)


# ---------------------------------------------------------------- draft worker (mesh B)


def draft_init(prog: Program, dflat, ids, lens, first):
    pre = Prefill(ids, lens, None, prog.capacity, prog.draft.capacity)
    return prog.draft.init(dflat, pre, first)


def draft_grow(prog_n: tuple[Program, int], dflat, s):
    """``n`` expansions, for ``prog_n = (prog, n)`` (a static count: a loop of known length
    needs no device-to-host check per iteration)."""
    prog, n = prog_n
    sh = prog.shape

    def one(_, st):
        return prog.draft.grow(dflat, st, expansions=1, width=sh.width, branch=sh.branch)

    return jax.lax.fori_loop(0, n, one, s)


def draft_snapshot(prog: Program, s):
    """The best bs nodes as a verify block at root slot/position 0 (the target shifts it), and
    the same packed for the target's mesh."""
    zero = jnp.zeros_like(s.tree.size)
    snap = snapshot(s.tree, prog.shape.bs, zero, zero)
    return snap, pack(snap)


def draft_next(prog: Program, dflat, s, snap: T.TreeBlock, packed):
    """One call on the verdict: re-root the grown tree (evolving tree cache), refill a tree
    smaller than bs + 1 nodes with at most ``prog.refill`` expansions (a tree always holds its
    root, so the snapshot is never empty), take the next snapshot. Returns (state, snapshot,
    the snapshot packed, refill expansions)."""
    v: Verdict = unpack(packed, prog.verdict_layout)
    s = prog.draft.commit(s, snap, v.path, v.n, v.next)
    sh = prog.shape

    def short(c):
        st, i = c
        return (i < prog.refill) & jnp.any(st.tree.size < sh.bs + 1)

    def grow(c):
        st, i = c
        return prog.draft.grow(dflat, st, expansions=1, width=sh.width, branch=sh.branch), i + 1

    s, grown = jax.lax.while_loop(short, grow, (s, jnp.zeros((), jnp.int32)))
    snap, flat = draft_snapshot(prog, s)
    return s, snap, flat, grown


def with_layouts(prog: Program, tflat, dflat, ids, lens) -> Program:
    """``prog`` with its snapshot and verdict layouts, from the workers' abstract outputs."""
    seed = np.uint32(0)
    ts, first = jax.eval_shape(lambda *a: target_prefill(prog, *a), tflat, ids, lens, seed)
    ds = jax.eval_shape(lambda *a: draft_init(prog, *a), dflat, ids, lens, first)
    snap, flat = jax.eval_shape(lambda s: draft_snapshot(prog, s), ds)
    prog = dataclasses.replace(prog, snap_layout=spec(snap))
    verdict = jax.eval_shape(lambda *a: target_verify(prog, *a), tflat, ts, flat)[1]
    return dataclasses.replace(prog, verdict_layout=spec(verdict))
