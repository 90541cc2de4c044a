"""Several processes as one JAX job, through JAX's own multi-controller runtime.

``initialize`` starts ``jax.distributed`` (process 0 hosts its coordination service) and checks
that every process was started alike: the same ``num_processes`` (``agree``, through the
runtime's key-value store). After it, ``jax.devices()`` lists every process's devices and each
process runs the same programs over global meshes; nothing here is a transport of its own.

Faults. JAX's runtime watches the processes by heartbeats: when one dies (or one never joins
within ``timeout_s``), it terminates the others (SIGABRT, with its message "the JAX distributed
service detected fatal errors") within about that time, instead of leaving a collective hanging.
JAX 0.11.2 offers no way to turn that into an exception in the surviving process (its callback
for it cannot be set from Python), so the command line runs each distributed process under a
supervisor (``jaxspec.launch``) that reports it as a ``WorkerError``.

Moving data. ``transfer`` copies a small array between meshes that sit in different processes,
as one collective over both meshes' devices: a cross-process ``jax.device_put`` needs a DCN
transfer server that JAX 0.11.2's CPU client does not serve (the receiver waits forever).
``fetch`` brings a result to the host of every process.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import distributed as jax_distributed  # the runtime's key-value store (private)
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.errors import JaxspecError, OptionError, WorkerError

DEFAULT_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Session:
    """This process's place in the job, as ``initialize`` was given it."""

    coordinator: str
    num_processes: int
    process_id: int
    timeout_s: float


# The process's one runtime (JAX's own state is as global: one ``jax.distributed`` a process).
_SESSION: list[Session] = []
_CALLS: list[int] = [0]  # collective steps this process began (``step``): unique keys


def step() -> int:
    """A number that every process gets alike at the same point of the job (each process makes
    the same sequence of collective steps): unique names for keys and barriers."""
    _CALLS[0] += 1
    return _CALLS[0]


def session() -> Session | None:
    return _SESSION[0] if _SESSION else None


def is_leader() -> bool:
    """Whether this process prints and writes results: process 0, or the only one."""
    return jax.process_index() == 0


def parse_coordinator(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 hosts in brackets) -> (host, port); OptionError naming the flag."""
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^:\s\[\]]+):(\d+)", text or "")
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise OptionError(
            f"--coordinator takes HOST:PORT (e.g. 10.0.0.1:12355, the address of process 0 and "
            f"a free port there), got {text!r}."
        )
    return m.group(1), int(m.group(2))


def check_layout(num_processes, process_id) -> None:
    """The process count and id make sense: n >= 1 and 0 <= id < n (OptionError)."""
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise OptionError(f"--num-processes must be an integer >= 1, got {num_processes!r}.")
    if isinstance(process_id, bool) or not isinstance(process_id, int):
        raise OptionError(f"--process-id must be an integer, got {process_id!r}.")
    if not 0 <= process_id < num_processes:
        raise OptionError(
            f"--process-id must be in [0, {num_processes - 1}] for --num-processes "
            f"{num_processes}, got {process_id}."
        )


def initialize(
    coordinator: str, num_processes: int, process_id: int, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Session:
    """Join the job: ``jax.distributed.initialize`` with ``timeout_s`` for joining and for the
    heartbeats, then ``agree`` on ``num_processes``. Call it before anything touches a device.

    JAX's preemption service is turned off first: it would catch SIGTERM (a launcher's or a
    scheduler's stop) and keep the process running."""
    parse_coordinator(coordinator)
    check_layout(num_processes, process_id)
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s >= 1):
        raise OptionError(f"--timeout must be at least 1 second, got {timeout_s!r}.")
    if _SESSION:
        raise OptionError("this process already joined a distributed job; initialize once.")
    seconds = math.ceil(timeout_s)
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(
        coordinator,
        num_processes,
        process_id,
        initialization_timeout=seconds,
        heartbeat_timeout_seconds=seconds,
        shutdown_timeout_seconds=seconds,
    )
    _SESSION.append(Session(coordinator, num_processes, process_id, float(timeout_s)))
    agree("--num-processes", str(num_processes), error=OptionError)
    return _SESSION[0]


def agree(
    what: str,
    value: str | None,
    *,
    shown: str | None = None,
    error: type[JaxspecError] = JaxspecError,
) -> None:
    """Check that every process has the same ``value`` for ``what`` (a flag, a checkpoint's
    fingerprint, a command), through the runtime's key-value store; raise ``error`` naming the
    processes that differ from the first and what each has (``shown``, default the value).
    ``None`` abstains (a process with nothing to compare). Every process must make the same
    sequence of calls; one that does not arrive within the timeout is a ``WorkerError``. A
    single process agrees with itself."""
    s = session()
    if s is None:
        return
    client = jax_distributed.global_state.client
    key = f"jaxspec/agree/{step()}/{re.sub(r'[^A-Za-z0-9_.-]', '_', what)}"
    mine = None if value is None else [value, value if shown is None else shown]
    client.key_value_set(f"{key}/{s.process_id}", json.dumps(mine))
    wait_ms = int(s.timeout_s * 1000)
    values = {}
    for p in range(s.num_processes):
        try:
            got = json.loads(client.blocking_key_value_get(f"{key}/{p}", wait_ms))
        except Exception as e:  # the runtime's timeout: DEADLINE_EXCEEDED
            raise WorkerError(
                f"process {p} did not reach the check of {what} within {s.timeout_s:g} s "
                f"(it died, hangs, or runs another command); stopping ({type(e).__name__})."
            ) from None
        if got is not None:
            values[p] = got
        if len({v for v, _ in values.values()}) > 1:  # at once: the rest may never arrive
            first = min(values)
            differ = sorted(p for p, (v, _) in values.items() if v != values[first][0])
            text = "; ".join(f"process {p}: {_short(t)}" for p, (_, t) in sorted(values.items()))
            who = (
                f"process {differ[0]} differs"
                if len(differ) == 1
                else (f"processes {', '.join(map(str, differ))} differ")
            )
            raise error(
                f"the processes disagree on {what} ({who} from process {first}): {text}. Start "
                f"them alike: {what} must be the same in every process."
            )


def _short(value: str) -> str:
    return value if len(value) <= 160 else value[:157] + "..."


# ---------------------------------------------------------------- moving data between processes


def _processes(sharding) -> frozenset[int]:
    return frozenset(d.process_index for d in sharding.device_set)


def spans(*shardings) -> bool:
    """Whether these shardings' devices belong to more than one process: then what is run on
    them must be decided alike in every process (by no clock, no local event)."""
    return len(frozenset().union(*(_processes(s) for s in shardings))) > 1


def transfer(x: jax.Array, dst: NamedSharding) -> jax.Array:
    """``x`` (replicated on its devices; integers, bools or 32-bit floats) as an array
    replicated over ``dst`` (``dst.spec`` must replicate).

    Within one process this is ``jax.device_put``. Across processes it is one program over the
    union of both device sets that every process of either set runs (``psum`` of the source's
    copy and zeros, as int32: the same bits arrive), and a process that holds none of the
    devices must still make the call, in the same order as the others, as with every
    multi-controller program."""
    procs = _processes(x.sharding) | _processes(dst)
    if len(procs) == 1:  # decided alike in every process, as the collective below must be
        if jax.process_index() in procs:
            return jax.device_put(x, dst)
        return jax.make_array_from_single_device_arrays(x.shape, dst, [], dtype=x.dtype)
    devices = list(x.sharding._device_assignment)
    devices += [d for d in dst._device_assignment if d not in set(devices)]
    n = math.prod(x.shape)
    local = {s.device: s.data for s in x.addressable_shards}
    me = jax.process_index()
    parts = [
        _as_int32(local[d]).reshape(1, n) if d in local else jnp.zeros((1, n), jnp.int32, device=d)
        for d in devices
        if d.process_index == me
    ]
    union = NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec("x"))
    whole = jax.make_array_from_single_device_arrays(
        (len(devices), n), union, parts, dtype=jnp.int32
    )
    out = _broadcast(union.mesh)(whole)
    mine = [
        _from_int32(s.data.reshape(x.shape), x.dtype)
        for s in out.addressable_shards
        if s.device in dst.device_set
    ]
    return jax.make_array_from_single_device_arrays(x.shape, dst, mine, dtype=x.dtype)


def _as_int32(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.floating):
        if x.dtype.itemsize != 4:
            raise ValueError(f"transfer takes 32-bit floats, got {x.dtype}")
        return jax.lax.bitcast_convert_type(x, jnp.int32)
    return x.astype(jnp.int32)


def _from_int32(x: jax.Array, dtype) -> jax.Array:
    if jnp.issubdtype(dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, dtype)
    return x.astype(dtype)


@functools.lru_cache(maxsize=64)
def _broadcast(mesh: Mesh):
    """Row 0 of a ``[devices, n]`` array on every device of ``mesh`` (a psum with the other rows
    zeroed: exact for integers)."""

    def body(rows):
        first = jax.lax.axis_index("x") == 0
        return jax.lax.psum(jnp.where(first, rows, jnp.zeros_like(rows)), "x")

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("x"), out_specs=PartitionSpec("x"))
    )


def local(x: jax.Array) -> np.ndarray:
    """This process's copy of a replicated array, as numpy (no communication)."""
    if not x.addressable_shards:
        raise WorkerError(f"this process holds no copy of an array on {x.sharding}")
    return np.asarray(x.addressable_shards[0].data)


def fetch(tree):
    """Every leaf of ``tree`` as numpy, on every process: a replicated array over every process
    from the local copy, one split over every process through ``process_allgather``, one that
    lies in some processes only through a ``transfer`` to all devices. Every process must call
    it with the same tree (what communicates is decided by where each array lies)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return jax.tree.map(_fetch_one, tree)


def _fetch_one(x):
    # decided by where the array lies, which every process sees alike: the collectives match
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if _processes(x.sharding) == frozenset(range(jax.process_count())):
        if x.is_fully_replicated:
            return local(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    if not x.is_fully_replicated:
        raise WorkerError(f"cannot fetch an array split over part of the processes ({x.sharding})")
    everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("all",)), PartitionSpec())
    return local(transfer(x, everywhere))
