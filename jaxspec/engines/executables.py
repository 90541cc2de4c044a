"""Compiled programs kept on disk, so that a later process skips JAX's trace and lowering too.

JAX's persistent compilation cache (on in the CLI) skips XLA's compile but not JAX's trace and
lowering, which it needs to compute its own key: in a warm ``jaxspec generate`` of the default
model on the 2-core CPU they were 3.1 of the 4.0 s spent in ``programs.compiled`` (cProfile of one
run, benchmarks/notes/warm_start_cpu.md). Here a program is found by a digest of everything that
decides what it computes, without tracing it:

- the function (module and qualified name) and the static program, walked field by field
  (``describe``); anything without an exact, process-independent description (a closure, an
  array, an object with state this walk cannot see) makes the program one that is never kept;
- the arguments' shapes, dtypes and shardings (``compiled``'s key), the donated positions and
  the XLA options;
- the source of ``jaxspec`` and ``pallas_kernels`` (a digest of every ``.py`` file), the versions
  of Python, jax, jaxlib and flax, the backend and its devices, JAX's configuration and
  ``XLA_FLAGS`` (read as XLA reads it: it changes what XLA compiles).

The store lives beside JAX's cache (``<jax_compilation_cache_dir>/jaxspec``) and is on exactly
when that cache is: the CLI turns both on, ``--no-compile-cache`` both off; the test suite keeps
them off. A file that cannot be read back is removed and the program compiled again. Several
processes (``jax.distributed``) never use it: their programs span processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import inspect
import os
import pathlib
import pickle
import sys
import tempfile
import threading

import flax
import jax
import jaxlib
import numpy as np
from jax._src import compilation_cache as jax_cache  # its memoized "is the cache used"
from jax._src import xla_bridge
from jax.experimental import serialize_executable
from jax.sharding import Mesh, Sharding
from jax.tree_util import PyTreeDef


class Unstable(Exception):
    """A static value with no exact description that holds across processes."""


_ROOTS = ("jaxspec", "pallas_kernels")


def folder() -> pathlib.Path | None:
    """Where programs are kept: beside JAX's persistent cache, when it is on (and one process)."""
    where = jax.config.jax_compilation_cache_dir
    if not where or jax.process_count() > 1:
        return None
    return pathlib.Path(where) / "jaxspec"


def describe(x) -> str:
    """An exact text of a static value, the same in every process, or ``Unstable``."""
    if x is None or isinstance(x, bool | int | float | str | bytes):
        return repr(x)  # a float's repr reads back to the same float
    if isinstance(x, enum.Enum):
        return f"{_path(type(x))}.{x.name}"
    if isinstance(x, tuple | list):
        return f"{_path(type(x))}({','.join(describe(y) for y in x)})"
    if isinstance(x, frozenset | set):
        return f"{_path(type(x))}{{{','.join(sorted(describe(y) for y in x))}}}"
    if isinstance(x, dict):
        items = sorted(f"{describe(k)}:{describe(v)}" for k, v in x.items())
        return f"{_path(type(x))}{{{','.join(items)}}}"
    if isinstance(x, type):
        return _path(x)
    if isinstance(x, np.dtype):
        return f"dtype:{x.name}"
    if isinstance(x, functools.partial):
        return f"partial({describe(x.func)},{describe(x.args)},{describe(x.keywords)})"
    if inspect.isfunction(x) or inspect.isbuiltin(x):
        return _path(x)
    if isinstance(x, Mesh):  # its repr names the axes, not the devices
        ids = np.vectorize(lambda d: d.id, otypes=[int])(x.devices).tolist()
        return f"Mesh({describe(x.axis_names)},{ids},{describe(tuple(map(str, x.axis_types)))})"
    if isinstance(x, Sharding):  # nor does a NamedSharding's: the devices in order go beside it
        devices = getattr(x, "_device_assignment", None)
        if devices is None:
            raise Unstable(f"a {type(x).__name__} without its devices")
        return f"{_plain(type(x), repr(x))}@{[d.id for d in devices]}"
    if isinstance(x, PyTreeDef | flax.nnx.GraphDef):
        return _structure(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = [f.name for f in dataclasses.fields(x) if f.compare]
        return f"{_path(type(x))}({','.join(f'{n}={describe(getattr(x, n))}' for n in fields)})"
    if isinstance(x, np.generic):
        return f"{x.dtype.name}:{x.item()!r}"
    if type(x).__module__.split(".")[0] in _ROOTS and getattr(x, "__dict__", None) == {}:
        return f"{_path(type(x))}()"  # one of ours without state (an engine): its class says it
    raise Unstable(f"no exact description of a {type(x).__name__}")


@functools.lru_cache(maxsize=16)
def _structure(x) -> str:
    """A treedef's or graphdef's text: its repr spells out every node and attribute. Kept per
    structure, as a process's programs share their model's (a SmolLM2 graphdef's repr took 65
    ms, and a warm ``jaxspec generate`` looks up two programs)."""
    return _plain(type(x), repr(x))


def _path(obj) -> str:
    name = getattr(obj, "__qualname__", "")
    if not name or "<" in name:  # a lambda or a function defined in a function: a closure
        raise Unstable(f"{obj!r} has no importable name")
    return f"{obj.__module__}.{name}"


def _plain(kind: type, text: str) -> str:
    if " at 0x" in text:
        raise Unstable(f"a {kind.__name__} describes itself by its address")
    return f"{_path(kind)}:{text}"


@functools.cache
def _sources() -> str:
    """A digest of the library's own code: a changed line is another program."""
    h = hashlib.sha256()
    for root in _ROOTS:
        base = pathlib.Path(sys.modules[root].__file__).parent
        for path in sorted(base.rglob("*.py")):
            h.update(str(path.relative_to(base)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _environment() -> str:
    devices = tuple((d.platform, d.device_kind, d.id) for d in jax.devices())
    config = {
        k: v for k, v in jax.config.values.items() if v is None or isinstance(v, bool | int | str)
    }
    versions = (sys.version, jax.__version__, jaxlib.__version__, flax.__version__)
    backend = jax.devices()[0].client.platform_version
    return describe((versions, backend, devices, config, os.environ.get("XLA_FLAGS"), _sources()))


def digest(fn, static, key, donate, options) -> str | None:
    """The file name a program is kept under, or None when it has no exact description."""
    try:
        text = describe((fn, static, key, tuple(donate), options))
        env = _environment()
    except Unstable:
        return None
    return hashlib.sha256(f"{text}\n{env}".encode()).hexdigest()


_FRESH = threading.Lock()
_fresh = {"depth": 0, "used": False}


@contextlib.contextmanager
def fresh():
    """A context in which compiles skip JAX's persistent cache, so a program to keep is compiled
    anew: on a CPU an executable JAX read back from its cache serializes without its compiled
    functions (running the copy in another process fails with "Function ... not found").

    JAX decides once per process whether its cache is used (``is_cache_used``, memoized), so
    its thread-local ``enable_compilation_cache(False)`` switch is ignored after the first
    compile: a warm ``jaxspec generate`` after an upgrade (the same programs under new names)
    kept broken copies. So the memoized answer itself is turned off while any keeping compile
    runs, and restored after the last one. Other threads' compiles in that window compile anew
    too (correct, just not cached)."""
    with _FRESH:
        if _fresh["depth"] == 0:  # settled first with the process's own setting
            _fresh["used"] = jax_cache.is_cache_used(xla_bridge.get_backend())
            _set_cache_used(False)
        _fresh["depth"] += 1
    try:
        yield
    finally:
        with _FRESH:
            _fresh["depth"] -= 1
            if _fresh["depth"] == 0:
                _set_cache_used(_fresh["used"])


def _set_cache_used(used: bool) -> None:
    with jax_cache._cache_initialized_mutex:
        jax_cache._cache_used = used


def load(where: pathlib.Path, name: str):
    """The kept program ``name`` loaded onto this backend's devices, or None."""
    path = where / f"{name}.exe"
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    try:
        serialized, in_tree, out_tree, ids = pickle.loads(blob)
        by_id = {d.id: d for d in jax.devices()}
        return serialize_executable.deserialize_and_load(
            serialized, in_tree, out_tree, execution_devices=[by_id[i] for i in ids]
        )
    except Exception:  # written by another build or cut short: compile it again
        path.unlink(missing_ok=True)
        return None


def keep(where: pathlib.Path, name: str, exe) -> None:
    """Write ``exe`` as ``name``, whole or not at all (a temporary file renamed); a program
    that cannot be serialized, or a folder that cannot be written, is simply not kept."""
    unloaded = getattr(exe._executable, "_unloaded_executable", None)
    if unloaded is None or unloaded.host_callbacks or unloaded.ordered_effects:
        return  # a host callback is a Python object of this process: it does not travel
    ids = [d.id for d in unloaded.device_list]  # the devices it runs on, in order
    try:
        blob = pickle.dumps((*serialize_executable.serialize(exe), ids))
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, suffix=".part")
    except (OSError, ValueError, NotImplementedError, pickle.PicklingError, TypeError,
            AttributeError):  # fmt: skip
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, where / f"{name}.exe")
    except OSError:
        pathlib.Path(tmp).unlink(missing_ok=True)
