"""Where a result comes from: date, device, jax version, commit and command, recorded beside every
benchmark figure and trained draft."""

from __future__ import annotations

import datetime
import os
import pathlib
import platform
import subprocess
import sys

import jax

ROOT = pathlib.Path(__file__).resolve().parent.parent


def metadata() -> dict:
    """date, device, jax version, commit (``-dirty`` with uncommitted changes), command, and
    ``xla_flags`` when ``XLA_FLAGS`` is set.

    ``JAXSPEC_COMMIT`` wins when set: a copy of the tree on another machine (the GPU runs) may
    carry a stale ``.git``."""
    try:
        if os.environ.get("JAXSPEC_COMMIT", "unknown") != "unknown":
            raise OSError("commit given by JAXSPEC_COMMIT")
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        commit += "-dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = os.environ.get("JAXSPEC_COMMIT", "unknown")
    dev = jax.devices()[0]
    device = (
        f"{dev.device_kind} x{jax.device_count()}"
        if dev.platform != "cpu"
        else f"CPU ({os.cpu_count()} cores, {platform.machine()})"
    )
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "jax": jax.__version__,
        "commit": commit,
        "command": _command(sys.argv),
    }
    if os.environ.get("XLA_FLAGS"):  # compiler options change the figures: keep them with them
        meta["xla_flags"] = os.environ["XLA_FLAGS"]
    return meta


def _command(argv: list[str]) -> str:
    """The command line as typed: ``jaxspec ...`` for the CLI (console script or ``python -m
    jaxspec.cli``), else ``python SCRIPT ...``."""
    head = argv[0] if argv else ""
    cli = ("jaxspec/cli.py", "jaxspec/cli/__main__.py", "jaxspec.cli")
    if pathlib.Path(head).name == "jaxspec" or head.endswith(cli):
        return " ".join(["jaxspec", *argv[1:]])
    return " ".join(["python", *argv])  # the interpreter's own name (python3.13, ...) is noise
