"""Starting and watching the processes of a distributed run: ``jaxspec launch -n N -- COMMAND``
(N processes on this machine, for trying it and for tests), the supervisor that every
distributed ``generate`` or ``bench`` process runs under, and the command line's job flags
(``--tp``, ``--coordinator``, ``--num-processes``, ``--process-id``, ``--timeout`` and their
``JAXSPEC_*`` variables), which ``jaxspec.cli`` takes through three hooks: ``add_job_args``,
``run`` and ``target_mesh``.

Why a supervisor: JAX's runtime ends a process whose peer died, stopped answering, or never
joined with SIGABRT (see ``jaxspec.distributed``); no exception reaches Python. The command a
user starts (``jaxspec generate ... --coordinator ...``) therefore runs the work in a child
process and reports such an end as a ``WorkerError``: ``error: ...`` and exit code 2, within
about the timeout, on every machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import jax

from jaxspec import distributed
from jaxspec.distributed import DEFAULT_TIMEOUT_S
from jaxspec.errors import DeviceError, OptionError, WorkerError
from jaxspec.model.sharding import tp_mesh

DISTRIBUTED = ("generate", "bench")  # the commands that run over several processes
JOB_FLAGS = ("--coordinator", "--num-processes", "--process-id", "--timeout")
SUPERVISED = "JAXSPEC_SUPERVISED"  # set in a child: it does the work itself
# each job flag's environment variable (a flag given wins); for schedulers that set them
ENV = {
    "coordinator": "JAXSPEC_COORDINATOR",
    "num_processes": "JAXSPEC_NUM_PROCESSES",
    "process_id": "JAXSPEC_PROCESS_ID",
    "timeout": "JAXSPEC_TIMEOUT",
}


# ---------------------------------------------------------------- the job flags of generate, bench


def add_job_args(p: argparse.ArgumentParser) -> None:
    """``--tp`` and the flags that make this process one of a distributed job."""
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="place the target on a tensor-parallel mesh of the first N devices of all "
        "processes (default: one device)",
    )
    p.add_argument(
        "--coordinator",
        default=None,
        help=f"HOST:PORT of process 0, which hosts the job's coordination ({ENV['coordinator']})",
    )
    p.add_argument(
        "--num-processes",
        type=int,
        default=None,
        help=f"processes in the job ({ENV['num_processes']})",
    )
    p.add_argument(
        "--process-id", type=int, default=None, help=f"this process's id ({ENV['process_id']})"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for a process to join or answer before every other one stops "
        f"with an error ({ENV['timeout']}; default {DEFAULT_TIMEOUT_S:g})",
    )


@dataclasses.dataclass(frozen=True)
class Job:
    coordinator: str
    num_processes: int
    process_id: int
    timeout_s: float


def _given(args, name: str, kind):
    value = getattr(args, name, None)
    if value is not None:
        return value
    text = os.environ.get(ENV[name], "").strip()
    if not text:
        return None
    try:
        return kind(text)
    except ValueError:
        raise OptionError(f"{ENV[name]} must be {kind.__name__}, got {text!r}.") from None


def job(args) -> Job | None:
    """The distributed job the flags (or their variables) describe; None for a plain run."""
    got = {
        "coordinator": _given(args, "coordinator", str),
        "num_processes": _given(args, "num_processes", int),
        "process_id": _given(args, "process_id", int),
    }
    timeout = _given(args, "timeout", float)
    if all(v is None for v in got.values()):
        if getattr(args, "timeout", None) is not None:
            raise OptionError(
                "--timeout applies to a distributed job; add --coordinator, --num-processes "
                "and --process-id (or run it through jaxspec launch)."
            )
        return None
    missing = [f"--{k.replace('_', '-')}" for k, v in got.items() if v is None]
    if missing:
        raise OptionError(
            f"a distributed job needs --coordinator, --num-processes and --process-id (or "
            f"{', '.join(ENV[k] for k in got)}); {', '.join(missing)} missing."
        )
    distributed.parse_coordinator(got["coordinator"])
    distributed.check_layout(got["num_processes"], got["process_id"])
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    if not timeout >= 1:
        raise OptionError(f"--timeout must be at least 1 second, got {timeout:g}.")
    return Job(got["coordinator"], got["num_processes"], got["process_id"], timeout)


def run(args, argv: list[str], work) -> int:
    """``work()`` as this command asks: in this process when no job is given; under a
    supervisor (``supervise``) for a job process that a user started; after joining the job
    for the supervised child (or a ``jaxspec launch`` one). A process other than 0 prints
    nothing and writes no ``--out`` (its errors still reach stderr)."""
    j = job(args) if args.command in DISTRIBUTED else None
    if j is None:
        return work()
    if getattr(args, "budget_s", None) is not None:
        raise OptionError(
            "--budget-s stops by the clock, and the processes of a job would stop at different "
            "batches (then wait on each other); leave it out and bound the run by --prompts."
        )
    if os.environ.get(SUPERVISED) != "1":
        return supervise(argv, j.process_id, j.timeout_s)
    distributed.initialize(j.coordinator, j.num_processes, j.process_id, timeout_s=j.timeout_s)
    if distributed.is_leader():
        return work()
    if getattr(args, "out", None) is not None:
        args.out = None
    with _quiet():
        return work()


@contextlib.contextmanager
def _quiet():
    """stdout and stderr to nowhere, restored before an error propagates (so it is shown)."""
    with open(os.devnull, "w") as sink:
        saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = sink
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved


def target_mesh(args):
    """The mesh ``--tp N`` asks for (the first N devices of all processes), or None."""
    n = getattr(args, "tp", None)
    if n is None:
        return None
    have = len(jax.devices())
    if n < 1 or n > have:
        raise DeviceError(
            f"--tp must be in [1, {have}] (the devices of all processes of this job), got {n}."
        )
    return tp_mesh(jax.devices()[:n])


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run a generate or bench command as N processes of one job on this machine",
        description="Starts N processes on 127.0.0.1 (a free port unless --port), each running "
        "COMMAND as one process of a distributed job (--coordinator, --num-processes, "
        "--process-id added). Process 0 prints the results; the output of the others is shown "
        "only if they fail. Example: jaxspec launch -n 2 --devices-per-process 2 -- generate "
        "'def fib(n):' --raw --tp 4",
    )
    p.add_argument("-n", "--num-processes", type=int, required=True, help="processes to start")
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="CPU devices each process shows (XLA_FLAGS --xla_force_host_platform_device_count);"
        " default: as the environment says",
    )
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for a process to join or answer (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- generate|bench ...")


def free_port(port: int | None) -> int:
    """``port`` if nothing listens there on 127.0.0.1, or a free one; OptionError if taken."""
    if port is not None and not 0 < port < 65536:
        raise OptionError(f"--port must be in [1, 65535], got {port}.")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port or 0))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise OptionError(
                f"port {port} on 127.0.0.1 is in use; give another --port, or leave it out and "
                "a free one is chosen."
            ) from None
        return s.getsockname()[1]


def _command(args) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd or cmd[0] not in DISTRIBUTED:
        got = repr(cmd[0]) if cmd else "nothing"
        raise OptionError(
            f"jaxspec launch runs {' or '.join(DISTRIBUTED)} (e.g. jaxspec launch -n 2 -- "
            f"generate 'hello' --tp 2); got {got}."
        )
    given = [f for f in JOB_FLAGS if any(a == f or a.startswith(f + "=") for a in cmd)]
    if given:
        raise OptionError(
            f"jaxspec launch sets {', '.join(given)} itself; leave "
            f"{'them' if len(given) > 1 else 'it'} out of the command."
        )
    return cmd


def _env(devices: int | None) -> dict:
    env = {**os.environ, SUPERVISED: "1"}
    if devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform" not in f]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    return env


def cmd_launch(args) -> int:
    """Start the processes, wait for all of them; the first failure ends the others within
    about the timeout (JAX's runtime stops them, or they are killed past it)."""
    if args.num_processes < 1:
        raise OptionError(f"-n must be at least 1, got {args.num_processes}.")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        raise OptionError(
            f"--devices-per-process must be at least 1, got {args.devices_per_process}."
        )
    if not args.timeout >= 1:
        raise OptionError(f"--timeout must be at least 1 second, got {args.timeout}.")
    cmd = _command(args)
    port = free_port(args.port)
    env = _env(args.devices_per_process)
    n = args.num_processes
    procs, logs = [], []
    for k in range(n):
        job = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n)]
        job += ["--process-id", str(k), "--timeout", f"{args.timeout:g}"]
        log = None if k == 0 else tempfile.TemporaryFile()
        out = subprocess.PIPE if k == 0 else subprocess.DEVNULL
        child = [sys.executable, "-m", "jaxspec.cli", *cmd, *job]
        procs.append(subprocess.Popen(child, env=env, stdout=out, stderr=log))
        logs.append(log)
    relay = _relay(procs[0].stdout)
    try:
        codes = _wait_all(procs, args.timeout)
    except KeyboardInterrupt:
        _stop(procs, args.timeout)
        return 130
    relay.join()
    return _report(codes, logs, args.timeout)


GLOO = b"[Gloo] "  # gloo's C++ code prints its connections on the process's stdout
# ...from several threads at once, so a line can lose its prefix to another: "[Gloo] Rank 0[Gloo]
# Rank 1 is connected to 3 peer ranks. ..." then " is connected to 3 peer ranks. ..." (seen in CI)
GLOO_CONNECTED = b"connected peer ranks"


def is_gloo(line: bytes) -> bool:
    """Whether a line of a child's stdout is gloo's connection report, whole or a fragment."""
    return line.startswith(GLOO) or GLOO_CONNECTED in line


def _relay(pipe) -> threading.Thread:
    """Copy a child's stdout to ours as it comes, without gloo's connection lines (they are not
    the command's output)."""

    def copy():
        out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
        for line in iter(pipe.readline, b""):
            if is_gloo(line):
                continue
            if out is None:
                sys.stdout.write(line.decode(errors="replace"))
            else:
                out.write(line)
            sys.stdout.flush()
        pipe.close()

    t = threading.Thread(target=copy, daemon=True)
    t.start()
    return t


def _wait_all(procs, timeout_s: float) -> list[int]:
    """Exit codes of every process; once one fails, the others get the timeout (and 10 s) to
    end before they are killed."""
    deadline = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        if deadline is None and any(c not in (None, 0) for c in codes):
            deadline = time.monotonic() + timeout_s + 10
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)


def _stop(procs, timeout_s: float) -> None:
    """After a Ctrl-C (which every child got too): wait for them, kill what stays."""
    end = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _report(codes: list[int], logs, timeout_s: float) -> int:
    if all(c == 0 for c in codes):
        return 0
    for k, (code, log) in enumerate(zip(codes, logs, strict=True)):
        if code == 0 or log is None:
            continue
        log.seek(0)
        for line in log.read().decode(errors="replace").splitlines()[-20:]:
            print(f"[process {k}] {line}", file=sys.stderr)
    for k, code in enumerate(codes):
        if code not in (0, 2):  # a process that failed with its own message said it already
            print(f"error: {ended(k, code, timeout_s)}", file=sys.stderr)
    return 130 if all(c in (0, 130) for c in codes) else 2


def ended(process_id: int, code: int, timeout_s: float) -> str:
    """What an exit code of a distributed process means, in words."""
    if code == -signal.SIGABRT:
        return (
            f"process {process_id} was ended by JAX's distributed runtime: another process died "
            f"or stopped answering, or not every process joined within --timeout {timeout_s:g} s "
            "(the runtime's message above says which)."
        )
    if code < 0:
        return f"process {process_id} was killed by {signal.Signals(-code).name}."
    return f"process {process_id} failed with exit code {code}."


def supervise(argv: list[str], process_id: int, timeout_s: float) -> int:
    """Run ``jaxspec ARGV`` in a child process and return its exit code, a runtime's abort (or
    another signal) reported as a ``WorkerError`` (raised: the CLI prints it, exit code 2)."""
    cmd = [sys.executable, "-m", "jaxspec.cli", *argv]
    child = subprocess.Popen(cmd, env=_env(None), stdout=subprocess.PIPE)
    relay = _relay(child.stdout)
    try:
        code = child.wait()
    except KeyboardInterrupt:  # the child got it too, and stops on its own
        _stop([child], timeout_s)
        return 130
    relay.join()
    if code >= 0:
        return code
    raise WorkerError(ended(process_id, code, timeout_s))
