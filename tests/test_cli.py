"""The command line as the README documents it: ``generate`` with method options, several
prompts, a prompts file, standard input, the answer streamed as it is accepted; ``--version``;
``--model`` on an HF folder converted once; and the per-user compilation cache, which a second
process reads instead of compiling."""

import ast
import io
import json
import os
import subprocess
import sys

import pytest

import jaxspec
from jaxspec import cli
from jaxspec.cli import generate as cli_generate
from jaxspec.cli.generate import option_value, parse_options
from jaxspec.errors import OptionError
from jaxspec.io import places
from jaxspec.measure import cost_model
from tests import hf_fixtures

ARGS = ["--raw", "--max-new-tokens", "6", "--no-compile-cache"]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    src = tmp_path_factory.mktemp("hf")
    hf_fixtures.save_hf_checkpoint("llama3.1", src, tokenizer=True)
    return src


@pytest.fixture(scope="module")
def ckpt(hf_folder, tmp_path_factory):
    dst = tmp_path_factory.mktemp("ck") / "m"
    return jaxspec.convert(hf_folder, dst, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def model(ckpt):
    return jaxspec.load(ckpt)


def _run(argv, capsys):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "text,value", [("4", 4), ("-2", -2), ("0.5", 0.5), ("threads", "threads"), ("none", None)]
)
def test_option_values_are_integers_numbers_or_words(text, value):
    assert option_value(text) == value and type(option_value(text)) is type(value)


@pytest.mark.parametrize(
    "items,flags,says",
    [
        (["width"], {}, "KEY=VALUE"),
        (["width="], {}, "KEY=VALUE"),
        (["=4"], {}, "KEY=VALUE"),
        (["width=4", "width=5"], {}, "--option width twice"),
        (["gamma=4"], {"gamma": 3}, "--gamma and --option gamma"),
    ],
)
def test_option_parsing_errors_name_the_option(items, flags, says):
    with pytest.raises(OptionError, match=says):
        parse_options(items, **flags)


def test_generate_takes_method_options(ckpt, model, capsys):
    argv = ["generate", "w3 w4 w5", "--model", str(ckpt), *ARGS, "--method", "chain"]
    argv += ["--draft", "ngram", "--option", "ngram=2", "--gamma", "2"]
    code, out, err = _run(argv, capsys)
    want = jaxspec.generate(model, "w3 w4 w5", max_new_tokens=6).text[0]
    assert code == 0 and out.strip() == want.strip() and "[chain]" in err


@pytest.mark.parametrize(
    "option,says",
    [("beams=2", "beams"), ("width=abc", "width"), ("width=0", "width"), ("loop=fast", "")],
)
def test_a_bad_method_option_exits_2_naming_it(ckpt, option, says, capsys):
    method = "swiftspec" if option.startswith("loop") else "tree"
    argv = ["generate", "w3", "--model", str(ckpt), *ARGS, "--method", method]
    code, _, err = _run([*argv, "--draft", "ngram", "--option", option], capsys)
    assert code == 2 and err.startswith("error: ") and says in err


def test_an_option_without_a_draft_asks_for_one(ckpt, capsys):
    code, _, err = _run(["generate", "w3", "--model", str(ckpt), *ARGS, "--option", "bs=4"], capsys)
    assert code == 2 and "--option bs" in err and "--draft" in err


def test_several_prompts_a_file_and_stdin(ckpt, model, tmp_path, monkeypatch, capsys):
    prompts = ["w3 w4", "w5 w6 w7", "w8", "w9 w10"]
    file = tmp_path / "more.json"
    file.write_text(json.dumps(prompts[2:3]))
    monkeypatch.setattr(sys, "stdin", io.StringIO(prompts[3]))
    argv = ["generate", prompts[0], prompts[1], "-", "--prompts-file", str(file)]
    code, out, err = _run([*argv, "--model", str(ckpt), *ARGS], capsys)
    assert code == 0, err
    order = [prompts[0], prompts[1], prompts[3], prompts[2]]  # arguments (- in place), file
    want = jaxspec.generate(model, order, max_new_tokens=6)
    answers = [a.split("---\n", 1)[1].strip() for a in out.split("--- ")[1:]]
    assert answers == [t.strip() for t in want.text]
    assert "--- 1 of 4 ---" in out and "--- 4 of 4 ---" in out


def test_no_prompt_and_empty_stdin_are_clear_errors(ckpt, monkeypatch, capsys):
    code, _, err = _run(["generate", "--model", str(ckpt), *ARGS], capsys)
    assert code == 2 and "give a prompt" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO("  \n"))
    code, _, err = _run(["generate", "-", "--model", str(ckpt), *ARGS], capsys)
    assert code == 2 and "standard input" in err


def test_one_prompt_is_streamed_as_accepted(ckpt, model, monkeypatch, capsys):
    writes = []
    real = sys.stdout.write
    monkeypatch.setattr(sys.stdout, "write", lambda s: writes.append(s) or real(s))
    code, out, _ = _run(["generate", "w3 w4 w5", "--model", str(ckpt), *ARGS], capsys)
    want = jaxspec.generate(model, "w3 w4 w5", max_new_tokens=6).text[0]
    assert code == 0 and out == want + "\n"
    assert len([w for w in writes if w.strip()]) >= 3  # piece by piece, not the answer at once


def test_exact_runs_the_invariant_numerics_and_equals_autoregressive(ckpt, monkeypatch, capsys):
    seen = []
    real = cli_generate.stream

    def spy(target, *a, **k):
        seen.append(target.kernels.invariant)
        return real(target, *a, **k)

    monkeypatch.setattr(cli_generate, "stream", spy)
    argv = ["generate", "w3 w4 w5", "--model", str(ckpt), *ARGS, "--dtype", "bfloat16"]
    code, out, _ = _run([*argv, "--method", "chain", "--draft", "ngram", "--exact"], capsys)
    bf16 = jaxspec.load(ckpt, dtype="bfloat16")
    want = jaxspec.generate(
        bf16, "w3 w4 w5", max_new_tokens=6, kernels=jaxspec.KernelConfig(invariant=True)
    ).text[0]
    assert code == 0 and out == want + "\n" and seen == [True]
    code, _, _ = _run(argv, capsys)  # without --exact: the default numerics
    assert code == 0 and seen == [True, False]


@pytest.mark.parametrize(
    "flags,refused",
    [
        ("--xla_gpu_deterministic_ops", True),
        ("--xla_dump_to=/tmp/x --xla_gpu_deterministic_ops=true", True),
        ("--xla_gpu_deterministic_ops=1", True),
        ("--xla_gpu_deterministic_ops=false", False),
        ("--xla_force_host_platform_device_count=2", False),
        ("", False),
    ],
)
def test_xla_flags_that_make_wrong_tokens_are_refused(flags, refused, ckpt, monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", flags)
    monkeypatch.setattr(cli.env, "load_target", lambda args: pytest.fail("loaded a model"))
    if refused:
        code, out, err = _run(["generate", "w3", "--model", str(ckpt), *ARGS], capsys)
        assert code == 2 and out == ""
        assert "XLA_FLAGS sets --xla_gpu_deterministic_ops" in err and "--exact" in err
    else:
        cli.env.check_xla_flags(flags)  # no error


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"jaxspec {jaxspec.__version__} (jax ")


def test_model_may_be_an_hf_folder_converted_once(hf_folder, model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(places, "checkout", lambda: None)  # as installed: the user cache folder
    monkeypatch.setenv("JAXSPEC_HOME", str(tmp_path))
    argv = ["generate", "w3 w4", "--model", str(hf_folder), "--dtype", "float32", *ARGS]
    code, first, err = _run(argv, capsys)
    assert code == 0 and "converting" in err and "once into" in err
    (folder,) = (tmp_path / "checkpoints").iterdir()
    code, again, err = _run(argv, capsys)
    assert code == 0 and "converting" not in err and again == first
    assert list((tmp_path / "checkpoints").iterdir()) == [folder]
    assert first.strip() == jaxspec.generate(model, "w3 w4", max_new_tokens=6).text[0].strip()


COUNTING = """
import collections, sys
import jax.monitoring
seen = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kw: seen.update([name]))
from jaxspec.cli import main
code = main(sys.argv[1:])
print("EVENTS " + repr(dict(seen)), file=sys.stderr)
sys.exit(code)
"""


def _events(argv, home):
    env = {**os.environ, "JAXSPEC_HOME": str(home)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("JAXSPEC_COMPILE_CACHE", None)  # the CLI's default: on
    r = subprocess.run(
        [sys.executable, "-c", COUNTING, *argv], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("EVENTS "))
    return ast.literal_eval(line[7:]), r.stdout, r.stderr


@pytest.mark.slow  # three processes that load JAX and compile: ~40 s on 2 loaded cores
def test_a_second_process_compiles_nothing(ckpt, tmp_path):
    argv = ["generate", "w3 w4 w5", "--model", str(ckpt), "--raw", "--max-new-tokens", "5"]
    first, out1, err1 = _events(argv, tmp_path)
    assert err1.count("compiling") == 2  # the prefill, a segment: kept whole, traced no more
    assert len(list((tmp_path / "xla" / "jaxspec").glob("*.exe"))) == 2
    second, out2, err2 = _events(argv, tmp_path)
    assert "compiling" not in err2 and out2 == out1
    assert second.get("/jax/compilation_cache/cache_misses", 0) == 0
    off, _, _ = _events([*argv, "--no-compile-cache"], tmp_path / "off")
    assert not [k for k in off if k.endswith(("/cache_hits", "/cache_misses"))]
    assert not (tmp_path / "off" / "xla").exists()


@pytest.mark.slow  # compiles the call's loop (and, for a long call, two units): ~40 s
@pytest.mark.parametrize("long", [False, True])
def test_magicdec_auto_says_what_it_measures_and_a_later_run_reuses_it(
    ckpt, tmp_path, monkeypatch, capsys, long
):
    monkeypatch.setenv("JAXSPEC_HOME", str(tmp_path))
    if long:  # a call long enough for another gamma to repay its compile: the units are timed
        monkeypatch.setattr(cost_model.Measurement, "settles", lambda self, tokens: False)
    argv = ["generate", "w3 w4 w5", "--model", str(ckpt), *ARGS, "--method", "magicdec"]
    argv += ["--draft", "self-streaming", "--option", "budget=32", "--option", "shape=chain"]
    argv += ["--max-new-tokens", "12"]  # alpha on the call's own loop (at least 8 tokens)
    code, first, err = _run(argv, capsys)
    assert code == 0, err
    assert "measuring MagicDec's cost model" in err and "measuring alpha" in err
    if long:
        assert "timing T_D, T_V(gamma=4)" in err and "T_V(gamma=2) read off the line" in err
    else:  # a tiny model's few tokens take milliseconds: no gamma repays a compile
        assert "T_D and T_V not timed" in err and "timing" not in err
    assert len(list((tmp_path / "profiles").glob("magicdec-chain-*.json"))) == 1
    code, again, err = _run(argv, capsys)  # a new model object: the profile comes from disk
    assert code == 0 and "measuring" not in err and "timing" not in err and again == first


EXIT = """
import atexit, sys, threading, time
from jaxspec.cli import exit_now
atexit.register(lambda: print("hook ran", file=sys.stderr))
if sys.argv[1] == "thread":  # a writer still running: the process must wait for it
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
print("answer", end="")
sys.stderr.write("note")
exit_now(int(sys.argv[2]))
"""


@pytest.mark.parametrize("case", ["alone", "thread"])
def test_exit_now_flushes_runs_the_hooks_and_keeps_the_code(case):
    """The CLI ends by ``exit_now`` (no interpreter teardown): what it printed still arrives,
    its exit hooks still run, its code is the process's, and a thread still at work is waited
    for."""
    r = subprocess.run(
        [sys.executable, "-c", EXIT, case, "3"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 3, r.stderr
    assert r.stdout.startswith("answer")
    assert "note" in r.stderr and "hook ran" in r.stderr
    assert ("thread done" in r.stdout) == (case == "thread")
