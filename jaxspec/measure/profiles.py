"""Measurements kept across processes: one JSON file per measured configuration in a folder the
caller names (the CLI: ``$JAXSPEC_HOME/profiles``, else ``~/.cache/jaxspec/profiles``), so a
later run on the same machine reuses what an earlier one measured instead of measuring again
(MagicDec's cost model: tens of seconds of compiles and timings on a CPU).

A file is named by the SHA-256 of its description: what was measured (the kind, the shapes, the
options) on what (jax and jaxspec versions, backend, device kind and count, the models' configs,
dtypes and a probe of their weights). Any change gives another file; a stale profile can only
make a choice slower, never a result different (the choices are gammas and shapes, all exact).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
from importlib import metadata

import jax
import numpy as np

from jaxspec.model.transformer import Model


def machine() -> dict:
    """The software and devices measurements depend on."""
    try:
        version = metadata.version("jaxspec")
    except metadata.PackageNotFoundError:
        version = "unknown"
    devices = jax.devices()
    return {
        "jaxspec": version,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": devices[0].device_kind,
        "devices": len(devices),
    }


def model_identity(model: Model) -> dict:
    """A model's config, dtype and a probe of its weights (a few values of every leaf)."""
    h = hashlib.sha256()
    for x in model.flat:
        h.update(np.asarray(jax.device_get(x.reshape(-1)[:8])).astype(np.float32).tobytes())
    return {
        "config": dataclasses.asdict(model.config),
        "dtype": str(model.flat[0].dtype),
        "probe": h.hexdigest()[:16],
    }


def _file(folder: pathlib.Path, description: dict) -> pathlib.Path:
    digest = hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode())
    return folder / f"{description.get('kind', 'profile')}-{digest.hexdigest()[:20]}.json"


def load(folder, description: dict) -> dict | None:
    """The stored measurement of ``description`` in ``folder``, or None."""
    if folder is None:
        return None
    path = _file(pathlib.Path(folder).expanduser(), description)
    try:
        return json.loads(path.read_text())["measured"]
    except (OSError, ValueError, KeyError):
        return None


def save(folder, description: dict, measured: dict) -> pathlib.Path | None:
    """Keep ``measured`` for ``description`` in ``folder`` (written atomically; best effort: a
    folder that cannot be written keeps nothing)."""
    if folder is None:
        return None
    folder = pathlib.Path(folder).expanduser()
    path = _file(folder, description)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"description": description, "measured": measured}, indent=1))
        tmp.replace(path)
    except OSError:
        with contextlib.suppress(OSError):  # its folder may be what could not be made
            tmp.unlink(missing_ok=True)
        return None
    return path


def describe(target, draft, options, kernels, batch, bucket, gammas) -> dict:
    """What a MagicDec cost-model profile depends on, besides its kind."""
    return {
        **machine(),
        "target": model_identity(target),
        "draft": model_identity(draft) if isinstance(draft, Model) else str(draft),
        "draft_options": {**options.draft_kwargs(), "sparse": options.sparse},
        "kernels": target.net(kernels).kernels.describe(),
        "batch": batch,
        "prefix_bucket": bucket,
        "gammas": list(gammas),
    }


def kept(owner: Model, key, profile_dir, description: dict, cls):
    """A measurement kept with ``owner`` (this process) or in ``profile_dir`` (an earlier one)."""
    m = owner._cache.get(key)
    if m is None:
        stored = load(profile_dir, description)
        if stored is not None:
            try:
                m = _restored(cls, stored)
            except (TypeError, ValueError, AttributeError):  # another layout: measure again
                return None
            owner._cache[key] = m
    return m


def _restored(cls, stored: dict):
    """A measurement dataclass from its stored fields."""
    if isinstance(stored.get("t_v"), dict):  # a chain's T_V by gamma: JSON keys are strings
        stored["t_v"] = {int(g): float(t) for g, t in stored["t_v"].items()}
    if isinstance(stored.get("interpolated"), list):  # a tuple in JSON is a list
        stored["interpolated"] = tuple(stored["interpolated"])
    return cls(**stored)


def keep(owner: Model, key, profile_dir, description: dict, m) -> None:
    """Keep a measurement (a dataclass) with ``owner`` and in ``profile_dir``."""
    owner._cache[key] = m
    save(profile_dir, description, dataclasses.asdict(m))
