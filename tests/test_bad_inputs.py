"""Bad inputs, one table: through the CLI each exits 2 with a one-line ``error:`` (or argparse's
usage error), no traceback and nothing new on disk; through the Python API each raises a
JaxspecError subclass. Each message names what to do, so the table pins a phrase of it."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest

import jaxspec
from jaxspec import cli
from jaxspec.errors import CheckpointError, DraftError, JaxspecError, OptionError, PromptError
from jaxspec.io import datasets
from jaxspec.io.paths import check_output_path
from tests import hf_fixtures

REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Bad:
    """``argv``: CLI words with ``{name}`` standing for a path of the ``world`` fixture;
    ``api``: the same mistake through Python, given the world; ``says``: a phrase of the
    message (the CLI's and the API's)."""

    name: str
    says: str
    argv: tuple[str, ...] | None = None
    api: Callable[[dict], object] | None = None
    exc: type[JaxspecError] = JaxspecError


def _gen(*words, model="{model}"):  # generate with few new tokens
    return ("generate", *words, "--model", model, "--raw", "--max-new-tokens", "4")


def _bench(*words):
    return ("bench", "--model", "{model}", "--prompts", "1", "--max-new-tokens", "2", *words)


def _distill(*words):
    return ("distill", "--target", "{model}", *words)


def _generate(w, prompts="w3 w4 w5", **kw):
    return jaxspec.generate(w["model_obj"], prompts, max_new_tokens=4, **kw)


def _fill(text: str, w: dict) -> str:
    return text.format(**{k: v for k, v in w.items() if isinstance(v, str | pathlib.Path)})


def convert_case(name, says, src, dst="{fresh}", *, overwrite=False) -> Bad:
    """``jaxspec convert SRC DST`` and ``jaxspec.convert(src, dst)``."""
    argv = ("convert", src, dst, *(("--overwrite",) if overwrite else ()))
    call = lambda w: jaxspec.convert(  # noqa: E731
        _fill(src, w), _fill(dst, w), progress=False, overwrite=overwrite
    )
    return Bad(name, says, argv, call, CheckpointError)


def model_case(name, says, model) -> Bad:
    """``generate --model MODEL`` and ``jaxspec.load(model)``."""
    call = lambda w: jaxspec.load(_fill(model, w))  # noqa: E731
    return Bad(name, says, _gen("w3", model=model), call, CheckpointError)


def dataset_case(name, says, dataset, n=1) -> Bad:
    """``bench --dataset DATASET --prompts N`` and ``datasets.load(dataset, n)``."""
    argv = (*_bench("--dataset", dataset), "--prompts", str(n))
    return Bad(name, says, argv, lambda w: datasets.load(_fill(dataset, w), n), OptionError)


def out_case(name, says, out) -> Bad:
    """``bench --out OUT`` and the check it runs before any work."""
    call = lambda w: check_output_path(_fill(out, w), "--out", folder=False)  # noqa: E731
    return Bad(name, says, _bench("--out", out), call, OptionError)


def generate_case(name, says, words=None, exc=JaxspecError, **kw) -> Bad:
    """``generate WORDS`` (None: no CLI form) and ``jaxspec.generate(model, ..., **kw)``."""
    return Bad(
        name, says, None if words is None else _gen(*words), lambda w: _generate(w, **kw), exc
    )


CASES = [
    # ---------------------------------------------------------------- convert: sources
    convert_case("convert-missing-source", "no checkpoint at", "{nowhere}"),
    convert_case("convert-not-a-checkpoint-file", "neither a folder nor a .gguf", "{text_file}"),
    convert_case("convert-garbage-gguf", "not a readable GGUF", "{garbage_gguf}"),
    convert_case("convert-folder-without-config", "no config.json", "{empty_dir}"),
    convert_case("convert-garbage-safetensors", "not a valid safetensors file", "{hf_garbage}"),
    convert_case(
        "convert-o_proj-bias",
        "bias model.layers.0.self_attn.o_proj.bias, which jaxspec does not support",
        "{hf_o_bias}",
    ),
    convert_case(
        "convert-mlp-bias", "mlp.down_proj.bias, which jaxspec does not support", "{hf_mlp_bias}"
    ),
    Bad(
        "convert-unknown-dtype",
        "unknown dtype",
        api=lambda w: jaxspec.convert(w["hf"], w["fresh"], dtype="float33", progress=False),
        exc=CheckpointError,
    ),
    Bad("convert-dtype-flag", "invalid choice", ("convert", "{hf}", "{fresh}", "--dtype", "f33")),
    # ---------------------------------------------------------------- convert: destinations
    convert_case("convert-under-a-file", "which is a file, not a folder", "{hf}", "{text_file}/c"),
    convert_case("convert-onto-a-file", "is a file, not a folder", "{hf}", "{text_file}"),
    convert_case("convert-unwritable", "cannot be written", "{hf}", "/proc/jaxspec-test/c"),
    convert_case(
        "convert-over-a-folder-without-overwrite",
        "already exists and is not empty",
        "{hf}",
        "{full_dir}",
    ),
    convert_case(
        "convert-overwrite-a-user-folder",
        "not a jaxspec checkpoint or draft",
        "{hf}",
        "{full_dir}",
        overwrite=True,
    ),
    convert_case("convert-overwrite-the-source", "is the source", "{hf}", "{hf}", overwrite=True),
    # ---------------------------------------------------------------- models and drafts
    model_case("model-missing", "no converted checkpoint at", "{nowhere}"),
    # the CLI converts an HF folder or a .gguf once (tests/test_cli.py); jaxspec.load does not
    Bad(
        "model-is-an-hf-folder",
        "convert it first: jaxspec convert {hf} {hf}-jaxspec",
        api=lambda w: jaxspec.load(_fill("{hf}", w)),
        exc=CheckpointError,
    ),
    Bad(
        "model-is-a-gguf",
        "convert it first: jaxspec convert {gguf} {gguf_stem}",
        api=lambda w: jaxspec.load(_fill("{gguf}", w)),
        exc=CheckpointError,
    ),
    model_case("model-without-params", "no params/", "{ckpt_no_params}"),
    model_case("model-corrupt-params", "could not restore the parameters", "{ckpt_truncated}"),
    model_case("model-bad-config", "not a valid jaxspec config", "{ckpt_bad_config}"),
    Bad(
        "load-unknown-dtype",
        "unknown dtype",
        api=lambda w: jaxspec.load(w["model"], dtype="int8"),
        exc=CheckpointError,
    ),
    Bad("model-dtype-flag", "invalid choice", _gen("w3", "--dtype", "float8")),
    Bad(
        "draft-misspelt-kind",
        "self-streaming, self-snapkv, ngram (did you mean ngram?)",
        _gen("w3", "--method", "chain", "--draft", "ngarm"),
    ),
    Bad(
        "draft-missing-folder",
        "neither a folder nor a known draft kind",
        _gen("w3", "--method", "chain", "--draft", "{nowhere}"),
    ),
    generate_case(
        "draft-unknown-kind", "unknown draft", None, DraftError, method="chain", draft="medusa"
    ),
    generate_case(
        "draft-not-a-model", "unknown draft 3", None, DraftError, method="chain", draft=3
    ),
    # ---------------------------------------------------------------- generate
    generate_case("empty-prompt", "empty", ("",), PromptError, prompts=""),
    generate_case(
        "blank-prompt-in-a-list", "prompt 1 is empty", None, PromptError, prompts=["w3", " "]
    ),
    generate_case("no-prompts", "no prompts", None, PromptError, prompts=[]),
    generate_case(
        "ids-outside-the-vocabulary",
        "outside the vocabulary",
        None,
        PromptError,
        prompts=[[3, 10**6]],
    ),
    generate_case(
        "prompt-longer-than-the-context",
        "exceeds the model's context",
        ("w3 " * 200,),
        PromptError,
        prompts="w3 " * 200,
    ),
    Bad("unknown-method-flag", "invalid choice", _gen("w3", "--method", "beam")),
    generate_case("unknown-method", "unknown method", None, OptionError, method="beam"),
    generate_case(
        "negative-temperature",
        "temperature",
        ("w3", "--temperature", "-1"),
        OptionError,
        temperature=-1.0,
    ),
    generate_case(
        "temperature-nan",
        "temperature must be finite",
        ("w3", "--temperature", "nan"),
        OptionError,
        temperature=float("nan"),
    ),
    Bad("temperature-not-a-number-flag", "invalid float value", _gen("w3", "--temperature", "hot")),
    generate_case(
        "top-p-zero", "must be in (0, 1]", ("w3", "--top-p", "0"), OptionError, top_p=0.0
    ),
    generate_case(
        "top-k-negative", "must be an integer >= 0", ("w3", "--top-k", "-2"), OptionError, top_k=-2
    ),
    Bad(
        "no-new-tokens",
        "must be a positive integer, got 0",
        ("generate", "w3", "--model", "{model}", "--raw", "--max-new-tokens", "0"),
        lambda w: jaxspec.generate(w["model_obj"], "w3", max_new_tokens=0),
        OptionError,
    ),
    generate_case(
        "chain-without-a-draft",
        "needs a draft",
        ("w3", "--method", "chain"),
        DraftError,
        method="chain",
    ),
    generate_case(
        "gamma-zero",
        "gamma",
        ("w3", "--method", "chain", "--draft", "ngram", "--gamma", "0"),
        OptionError,
        method="chain",
        draft="ngram",
        gamma=0,
    ),
    generate_case(
        "tree-depth-zero",
        "depth must be a positive integer",
        ("w3", "--method", "tree", "--draft", "ngram", "--depth", "0"),
        OptionError,
        method="tree",
        draft="ngram",
        depth=0,
    ),
    generate_case(
        "unknown-engine-option",
        "does not take",
        None,
        OptionError,
        method="chain",
        draft="ngram",
        beams=2,
    ),
    Bad(
        "swiftspec-with-ngram",
        "needs a draft model",
        _gen("w3", "--method", "swiftspec", "--draft", "ngram"),
    ),
    generate_case(
        "autoregressive-with-a-draft", "takes no draft", None, OptionError, draft="ngram"
    ),
    # ---------------------------------------------------------------- bench: prompts
    dataset_case("dataset-unknown", "unknown dataset 'humaneva'", "humaneva"),
    dataset_case("dataset-file-missing", "does not exist", "file:{nowhere}"),
    dataset_case(
        "dataset-file-not-utf8", "is not UTF-8 text (byte 0xff at offset 0)", "file:{latin1}"
    ),
    dataset_case("dataset-jsonl-bad-line", "line 2 of", "file:{bad_jsonl}"),
    dataset_case(
        "dataset-jsonl-object-line",
        "line 2 of {object_jsonl} is a JSON object, not a prompt",
        "file:{object_jsonl}",
    ),
    dataset_case(
        "dataset-json-object",
        "holds a JSON object where a list of prompts is expected",
        "file:{object_json}",
    ),
    dataset_case("dataset-json-float-ids", "a list holding 2.5", "file:{float_ids_json}"),
    dataset_case("dataset-file-empty", "holds no prompts", "file:{blank_txt}"),
    dataset_case("dataset-file-is-a-folder", "is a folder, not a file", "file:{empty_dir}"),
    dataset_case("too-many-prompts", "only 164", "humaneval", 165),
    dataset_case("zero-prompts", "must be positive", "humaneval", 0),
    Bad("prompts-not-a-number", "invalid int value", _bench("--prompts", "many")),
    # ---------------------------------------------------------------- bench: options and --out
    Bad("option-without-a-value", "--option takes KEY=VALUE", _bench("--option", "gamma")),
    Bad("option-not-an-integer", "gamma must be an integer", _bench("--option", "gamma=four")),
    Bad("bench-no-methods", "give at least one method", _bench("--methods", ",")),
    Bad("bench-unknown-method", "unknown method(s) beam", _bench("--methods", "beam")),
    Bad("bench-unknown-peer", "unknown peer(s) foo", _bench("--peers", "foo")),
    Bad("bench-zero-batch", "--batch must be positive", _bench("--batch", "0")),
    Bad("bench-negative-budget", "--budget-s must be positive", _bench("--budget-s", "-1")),
    out_case(
        "bench-out-under-a-file",
        "which is a file, not a folder; choose another --out",
        "{text_file}/bench.json",
    ),
    out_case("bench-out-unwritable", "cannot be written", "/proc/jaxspec-test/bench.json"),
    out_case("bench-out-is-a-folder", "is a folder; give a file path", "{empty_dir}"),
    # ---------------------------------------------------------------- distill and profile
    Bad(
        "distill-out-under-a-file",
        "which is a file, not a folder; choose another --out",
        _distill("--out", "{text_file}/run"),
    ),
    Bad("distill-out-is-a-file", "is a file, not a folder", _distill("--out", "{text_file}")),
    Bad("distill-out-unwritable", "cannot be written", _distill("--out", "/proc/jaxspec-test")),
    Bad(
        "distill-target-missing",
        "no converted checkpoint at",
        ("distill", "--target", "{nowhere}", "--out", "{fresh}"),
    ),
    Bad(
        "distill-zero-steps",
        "steps must be an integer >= 1",
        _distill("--out", "{fresh}", "--steps", "0"),
    ),
    Bad(
        "distill-zero-layers",
        "layers must be an integer >= 1",
        _distill("--out", "{fresh}", "--layers", "0"),
    ),
    Bad(
        "profile-zero-prompt-tokens",
        "--prompt-tokens must be positive",
        ("profile", "--model", "{model}", "--draft", "self-streaming", "--prompt-tokens", "0"),
    ),
    Bad(
        "profile-misspelt-draft",
        "did you mean self-streaming?",
        ("profile", "--model", "{model}", "--draft", "self-streamin"),
    ),
    Bad(
        "profile-magicdec-with-ngram",
        "speculates with a sparse-KV draft",
        ("profile", "--model", "{model}", "--draft", "ngram", "--method", "magicdec"),
    ),
    Bad(
        "profile-bad-batches",
        "--batches takes comma-separated positive integers",
        (
            "profile",
            "--model",
            "{model}",
            "--draft",
            "self-streaming",
            "--method",
            "magicdec",
            "--batches",
            "x",
        ),
    ),
    Bad("no-command", "required: COMMAND", ()),
]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The inputs that take time to make: a converted model, an HF folder, a GGUF, broken
    copies. Read-only for the cases: the test checks that none of them changes."""
    root = tmp_path_factory.mktemp("shared")
    hf = root / "hf"
    model = hf_fixtures.save_hf_checkpoint("llama3.1", hf, tokenizer=True)
    gguf = hf_fixtures.write_gguf(model, root / "tiny.gguf")
    ckpt = jaxspec.convert(hf, root / "ckpt", dtype="float32", progress=False)
    w = {"root": root, "hf": hf, "gguf": gguf, "gguf_stem": root / "tiny", "model": ckpt}
    for name, damage in [
        ("ckpt_no_params", lambda c: shutil.rmtree(c / "params")),
        ("ckpt_bad_config", lambda c: (c / "config.json").write_text("[1, 2")),
        ("ckpt_truncated", _truncate_arrays),
    ]:
        w[name] = shutil.copytree(ckpt, root / name)
        damage(w[name])
    for name, kw in [
        ("hf_o_bias", dict(attention_bias=True)),
        ("hf_mlp_bias", dict(mlp_bias=True)),
    ]:
        cfg = hf_fixtures.hf_config("llama2")
        for k, v in kw.items():
            setattr(cfg, k, v)
        import transformers

        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root / name)
        w[name] = root / name
    w["hf_garbage"] = shutil.copytree(hf, root / "hf_garbage")
    (w["hf_garbage"] / "model.safetensors").write_bytes(b"\x08" + bytes(4095))
    w["model_obj"] = jaxspec.load(ckpt)
    return w


def _truncate_arrays(ckpt: pathlib.Path) -> None:
    for p in (ckpt / "params").rglob("*"):
        if p.is_file() and p.parent.name == "d":
            os.truncate(p, p.stat().st_size // 2)


@pytest.fixture
def world(shared, tmp_path, monkeypatch):
    """``shared`` plus cheap per-test inputs in ``tmp_path`` (the working folder)."""
    monkeypatch.chdir(tmp_path)
    w = dict(shared, nowhere=tmp_path / "nowhere", fresh=tmp_path / "new" / "out")
    files = {
        "text_file": "not a folder\n",
        "latin1": b"\xff\xfeprompt in Latin-1 \xe9\n",
        "bad_jsonl": '"fine"\n{"unclosed": \n',
        "object_jsonl": '"fine"\n{"prompt": "an object"}\n',
        "object_json": json.dumps({"first": "a", "second": "b"}),
        "float_ids_json": json.dumps([[1, 2.5]]),
        "blank_txt": "\n  \n",
        "garbage_gguf": b"GGUF" + bytes(range(256)) * 8,
    }
    suffix = {"bad_jsonl": ".jsonl", "object_jsonl": ".jsonl", "object_json": ".json"}
    suffix |= {"float_ids_json": ".json", "garbage_gguf": ".gguf"}
    for name, content in files.items():
        path = tmp_path / f"{name}{suffix.get(name, '.txt')}"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        w[name] = path
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "full_dir").mkdir()
    (tmp_path / "full_dir" / "mine.txt").write_text("keep")
    w["empty_dir"], w["full_dir"] = tmp_path / "empty_dir", tmp_path / "full_dir"
    return w


def _snapshot(*roots: pathlib.Path) -> dict:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
        for root in roots
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("case", [c for c in CASES if c.argv is not None], ids=lambda c: c.name)
def test_cli_exits_2_with_one_clear_line(case, world, tmp_path, capsys):
    argv = [_fill(a, world) for a in case.argv]
    before = _snapshot(tmp_path, world["root"])
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == "", "a failing command printed to stdout"
    assert "Traceback" not in err
    assert _fill(case.says, world) in err
    assert "error: " in err and "error: " not in err.split("error: ", 1)[1]
    assert _snapshot(tmp_path, world["root"]) == before, "the command left something on disk"


@pytest.mark.parametrize("case", [c for c in CASES if c.api is not None], ids=lambda c: c.name)
def test_api_raises_a_jaxspec_error(case, world, tmp_path):
    before = _snapshot(tmp_path, world["root"])
    with pytest.raises(case.exc) as info:
        case.api(world)
    assert isinstance(info.value, JaxspecError)
    assert _fill(case.says, world) in str(info.value)
    assert _snapshot(tmp_path, world["root"]) == before


def test_output_paths_that_can_be_written_pass_and_create_nothing(tmp_path):
    (tmp_path / "old.json").write_text("{}")
    for path, folder in [
        (tmp_path / "new" / "deeper" / "bench.json", False),
        (tmp_path / "old.json", False),
        (tmp_path / "run", True),
        (tmp_path, True),
    ]:
        assert check_output_path(path, "--out", folder=folder) == path
    assert os.listdir(tmp_path) == ["old.json"]


def test_the_table_covers_at_least_40_cli_cases():
    assert len({c.name for c in CASES}) == len(CASES)
    assert sum(c.argv is not None for c in CASES) >= 40


# A real process for a few cases: the exit status and the absence of any traceback as a user
# sees them (warnings and tracebacks printed outside cli.main, at import or exit, show here).
SUBPROCESS_CASES = ["dataset-jsonl-object-line", "draft-misspelt-kind", "convert-under-a-file"]


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_a_real_process_exits_2_without_a_traceback(name, world, tmp_path):
    case = next(c for c in CASES if c.name == name)
    before = _snapshot(tmp_path, world["root"])
    proc = subprocess.run(
        [sys.executable, "-m", "jaxspec.cli", *(_fill(a, world) for a in case.argv)],
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert _fill(case.says, world) in proc.stderr
    assert _snapshot(tmp_path, world["root"]) == before
