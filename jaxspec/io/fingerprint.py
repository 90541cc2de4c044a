"""What identifies a converted checkpoint, so that the processes of a distributed job can check
that they load the same one (``jaxspec.distributed.agree``).

Two digests, both cheap. ``files``: the config (with the stored dtype), the tokenizer files and
Orbax's description of the parameter tree, read before any shard is; two conversions of one
model agree (Orbax's data files are named at random and packed differently each time, so they
are left out). ``weights``: the values of the small replicated parameters (the RMSNorm weights,
which every tensor-parallel layout keeps whole) that this process holds after the restore, so
that another model of the same shape is caught too; a process that holds no shard of the
model abstains. Hashing every weight would mean reading a 140 GB checkpoint twice.
"""

from __future__ import annotations

import hashlib
import pathlib

import jax
import numpy as np

from jaxspec import distributed
from jaxspec.errors import CheckpointError


def agree_files(path: pathlib.Path) -> None:
    """Every process of a job loads the checkpoint of the same description (CheckpointError)."""
    digest = files(path)
    shown = f"{path} (fingerprint {digest})"
    distributed.agree("the checkpoint", digest, shown=shown, error=CheckpointError)


def agree_weights(path: pathlib.Path, params) -> None:
    """Every process that holds a shard of the restored model holds the same small weights."""
    digest = weights(params)
    shown = f"{path} (weights {digest})"
    distributed.agree("the checkpoint's weights", digest, shown=shown, error=CheckpointError)


def files(path: pathlib.Path) -> str:
    """A short hex digest of the checkpoint folder ``path``'s description: ``config.json``,
    ``params/_METADATA`` and ``tokenizer/``."""
    h = hashlib.sha256()
    names = ["config.json", "params/_METADATA"]
    tok = path / "tokenizer"
    if tok.is_dir():
        names += sorted(str(f.relative_to(path)) for f in tok.rglob("*") if f.is_file())
    for name in names:
        f = path / name
        h.update(name.encode() + b"\0" + (f.read_bytes() if f.is_file() else b"(none)") + b"\0")
    return h.hexdigest()[:16]


def weights(params) -> str | None:
    """A short hex digest of the 1-D replicated parameter leaves this process holds (None when
    it holds none: its devices carry no shard of the model)."""
    h = hashlib.sha256()
    held = 0
    for x in jax.tree.leaves(params):
        if x.ndim != 1 or not x.is_fully_replicated or not x.addressable_shards:
            continue
        h.update(np.asarray(x.addressable_shards[0].data).tobytes())
        held += 1
    return h.hexdigest()[:16] if held else None
