"""Where jaxspec writes: output paths checked before any work, the temporary folders that make
every write atomic, and Ctrl-C held during a write until a point where stopping is safe.

A temporary folder sits beside its destination (same file system, so the final rename is
atomic) and is named after the process that owns it::

    .DST.tmp-<space>-<pid>-<start>-<token>

``space`` identifies the process-id space (host, boot and pid namespace), ``start`` is the
owner's start time in clock ticks (so a reused pid is told apart). The name, not a file inside,
carries the owner, because the folder is renamed as a whole: it stays recognisable at every
step. A folder whose owner is provably gone (a run killed with SIGKILL) is removed by the next
write into the same parent; one whose owner may be alive, or that another machine owns, is kept.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pathlib
import re
import secrets
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator

from jaxspec.errors import JaxspecError, OptionError

# Only "tmp" folders are ever swept: an "old" one (see convert._move_into_place) may hold the
# only copy of a checkpoint that a killed swap had moved aside.
_TEMP = re.compile(r"\.tmp-([0-9a-f]{8})-(\d+)-(\d+)-[0-9a-f]{8}$")
_NAME_ROOM = 100  # of DST's name in a temporary name: file names stop at 255 bytes


def check_output_path(
    path: str | os.PathLike,
    what: str,
    *,
    folder: bool,
    error: type[JaxspecError] = OptionError,
) -> pathlib.Path:
    """Refuse, before any work, an output path that cannot be written: one under a file, a
    folder where a file is wanted (or the reverse), or one whose nearest existing folder does not
    take new files. ``what`` names it in the message (a flag such as ``--out``). Creates
    nothing; returns the absolute path."""
    path = pathlib.Path(path).expanduser().absolute()
    if path.is_dir() and not folder:
        raise error(f"{what} {path} is a folder; give a file path, such as {path / 'out.json'}.")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() and (existing != path or folder):
        where = "is" if existing == path else f"is under {existing}, which is"
        raise error(f"{what} {path} {where} a file, not a folder; choose another {what}.")
    target = existing if existing.is_dir() else existing.parent
    try:
        # an unnamed file (O_TMPFILE where Linux has it): proves writing works, even for root
        # on a read-only mount, and leaves nothing behind
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as e:
        raise error(
            f"{what} {path} cannot be written: {target} does not take new files "
            f"({e.strerror or e}); choose a folder you can write to."
        ) from None
    return path


def temp_dir(dst: pathlib.Path, kind: str = "tmp") -> pathlib.Path:
    """A new hidden folder beside ``dst``, named after this process (see the module docstring),
    with the default permissions (``tempfile.mkdtemp`` would make it private to the user).
    Stale temporary folders in the same parent are removed first."""
    remove_stale_temp_dirs(dst.parent)
    owner = f"{_pid_space()}-{os.getpid()}-{_start_ticks(os.getpid()) or 0}"
    for _ in range(100):
        path = dst.parent / f".{dst.name[:_NAME_ROOM]}.{kind}-{owner}-{secrets.token_hex(4)}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise JaxspecError(f"could not create a temporary folder beside {dst}.")


def remove_stale_temp_dirs(parent: pathlib.Path) -> list[pathlib.Path]:
    """Remove the temporary folders in ``parent`` whose owner is provably gone; returns them."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP.search(entry.name)
        if not (m and entry.name.startswith(".") and entry.is_dir(follow_symlinks=False)):
            continue
        space, pid, start = m.group(1), int(m.group(2)), int(m.group(3))
        if space == _pid_space() and not _alive(pid, start):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(pathlib.Path(entry.path))
    return removed


@functools.cache
def _pid_space() -> str:
    """A short name for this process-id space: pids mean the same process only on one host, in
    one boot, in one pid namespace (containers on one host may share a host name)."""
    parts = [socket.gethostname()]
    try:
        parts.append(pathlib.Path("/proc/sys/kernel/random/boot_id").read_text())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:  # no /proc: the host name alone
        pass
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:8]


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces), or None."""
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _start_ticks(pid: int) -> int | None:
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None  # proc(5)'s field 22; the list starts at 3


def _alive(pid: int, start: int) -> bool:
    """False only when process ``pid`` started at ``start`` certainly no longer runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        pass
    fields = _proc_stat(pid)
    if fields is None:  # no /proc: the pid exists, so it may be the owner
        return True
    if fields[0] == "Z":  # exited, not yet reaped: it writes nothing more
        return False
    return not start or int(fields[19]) == start


@contextlib.contextmanager
def interrupts_held() -> Iterator[Callable[[], None]]:
    """Hold Ctrl-C (SIGINT) for the block: it is acted on, as the handler before would have
    acted, when the block calls the yielded ``check`` (a safe point) or ends.

    Raised wherever it lands, a KeyboardInterrupt can fall between creating a folder and the
    cleanup's knowing of it, inside a half-built object (whose ``__del__`` then prints a
    traceback), or in a gc callback that swallows it. And Orbax waits for its writer with
    ``Thread.join``: on CPython 3.12 an interrupt inside that join marks the thread finished, so
    Orbax's own wait on close returns at once while its writes go on and recreate what the
    cleanup removed. A second Ctrl-C acts at once (a folder it leaves is stale once the process
    is gone, and the next write beside it removes it). Outside the main thread, which Python's
    signals never reach, nothing is held.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    held = []

    def hold(signum, frame):
        held.append(frame)
        signal.signal(signal.SIGINT, previous)

    def check() -> None:
        if not held:
            return
        frame = held.pop()
        if callable(previous):
            previous(signal.SIGINT, frame)
        elif previous != signal.SIG_IGN:  # SIG_DFL, or a handler set outside Python
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)
    check()


@contextlib.contextmanager
def writing_beside(dst: pathlib.Path) -> Iterator[tuple[pathlib.Path, Callable[[], None]]]:
    """A temporary folder beside ``dst`` for a write that the block finishes by moving it into
    place, and the ``check`` of ``interrupts_held`` for the block's safe points. On any failure
    or interrupt the folder is removed, with the parent folders made for it."""
    made = [p for p in (dst.parent, *dst.parent.parents) if not p.exists()]
    with interrupts_held() as check:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_dir(dst)
        try:
            yield tmp, check
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            for p in made:  # innermost first
                with contextlib.suppress(OSError):
                    p.rmdir()
            raise
