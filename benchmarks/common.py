"""Shared bits of the benchmark scripts: run metadata, prompt sets, JSON output."""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def metadata() -> dict:
    from jaxspec.provenance import metadata as run_metadata

    return run_metadata()


def write(name: str, payload: dict, out: str | None = None) -> pathlib.Path:
    path = pathlib.Path(out) if out else RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def humaneval_prompts(n: int | None = None) -> list[str]:
    """HumanEval prompts (OpenAI, MIT licence): see jaxspec.io.datasets."""
    from jaxspec.io.datasets import humaneval

    return humaneval(n)
