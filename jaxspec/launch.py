"""Starting and watching the processes of a distributed run: ``jaxspec launch -n N -- COMMAND``
(N processes on this machine, for trying it and for tests) and the supervisor that every
distributed ``generate`` or ``bench`` process runs under.

Why a supervisor: JAX's runtime ends a process whose peer died, stopped answering, or never
joined with SIGABRT (see ``jaxspec.distributed``); no exception reaches Python. The command a
user starts (``jaxspec generate ... --coordinator ...``) therefore runs the work in a child
process and reports such an end as a ``WorkerError``: ``error: ...`` and exit code 2, within
about the timeout, on every machine.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from jaxspec.distributed import DEFAULT_TIMEOUT_S
from jaxspec.errors import OptionError, WorkerError

DISTRIBUTED = ("generate", "bench")  # the commands that run over several processes
JOB_FLAGS = ("--coordinator", "--num-processes", "--process-id", "--timeout")
SUPERVISED = "JAXSPEC_SUPERVISED"  # set in a child: it does the work itself


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
        out = None if k == 0 else subprocess.DEVNULL
        child = [sys.executable, "-m", "jaxspec.cli", *cmd, *job]
        procs.append(subprocess.Popen(child, env=env, stdout=out, stderr=log))
        logs.append(log)
    try:
        codes = _wait_all(procs, args.timeout)
    except KeyboardInterrupt:
        _stop(procs, args.timeout)
        return 130
    return _report(codes, logs, args.timeout)


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
    child = subprocess.Popen([sys.executable, "-m", "jaxspec.cli", *argv], env=_env(None))
    try:
        code = child.wait()
    except KeyboardInterrupt:  # the child got it too, and stops on its own
        _stop([child], timeout_s)
        return 130
    if code >= 0:
        return code
    raise WorkerError(ended(process_id, code, timeout_s))
