"""Which Pallas kernels a trace may use: the ``JAXSPEC_FUSED_*`` switches resolved against the
backend, and programs over sharded arrays traced without them.

The fused kernels (projections, attention, the cache commit) have no partitioning rule, so a
program over arrays laid out on several devices (tensor parallel weights, SwiftSpec's two-device
program) is traced inside ``fused_kernels_off()``: its Pallas calls would see whole arrays and the
partitioner would gather them.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax

from jaxspec.errors import OptionError

CHOICES = ("off", "auto", "pallas", "interpret")
_LOCAL = threading.local()


@contextlib.contextmanager
def fused_kernels_off():
    """Trace without the fused kernels (in this thread): for sharded arrays, which their Pallas
    calls cannot take."""
    before = getattr(_LOCAL, "off", False)
    _LOCAL.off = True
    try:
        yield
    finally:
        _LOCAL.off = before


def kernels_off() -> bool:
    """Whether this thread traces inside ``fused_kernels_off()``."""
    return getattr(_LOCAL, "off", False)


def spans_devices(*trees) -> bool:
    """Whether any array in ``trees`` (models' ``params`` are looked into) is laid out over
    several devices: tensor parallel weights, or SwiftSpec's two-device program."""
    leaves = jax.tree.leaves([getattr(t, "params", t) for t in trees])
    return any(len(getattr(getattr(x, "sharding", None), "device_set", ())) > 1 for x in leaves)


def fused_kernels_for(*trees):
    """``fused_kernels_off()`` when ``trees`` span several devices (the fused kernels have no
    partitioning rule), else a context that changes nothing. Trace programs inside it."""
    return fused_kernels_off() if spans_devices(*trees) else contextlib.nullcontext()


def traced_for_layout(fn):
    """Decorate a function that traces programs over its arguments (models, parameters,
    arrays): it runs under ``fused_kernels_for`` of them."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with fused_kernels_for(*args, *kwargs.values()):
            return fn(*args, **kwargs)

    return wrapped


def resolve(setting: str, switch: str) -> str | None:
    """A kernel switch's value (``switch`` names its environment variable, for the error) as
    'pallas' / 'interpret', or None for the plain path: 'auto' is 'pallas' on a GPU; every
    setting is None inside ``fused_kernels_off()``. A bad setting is an ``OptionError`` (the
    CLI prints it and exits 2)."""
    if setting not in CHOICES:
        raise OptionError(
            f"{switch} must be one of {', '.join(CHOICES)}; got {setting!r}. Set it to one of "
            "those, or unset it for the default."
        )
    if setting == "pallas" and jax.default_backend() != "gpu":
        raise OptionError(
            f"{switch}=pallas needs a GPU backend; use 'interpret' or 'auto' here, or unset it."
        )
    if setting == "auto":
        setting = "pallas" if jax.default_backend() == "gpu" else "off"
    return None if setting == "off" or kernels_off() else setting
