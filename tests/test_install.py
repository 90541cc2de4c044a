"""jaxspec installed from its wheel, away from the checkout: the wheel holds every module, the
prompt sets and the shipped draft; installed with ``--no-deps`` beside the test venv's packages
(``pip --target`` plus ``PYTHONPATH``), it runs from another folder and writes its checkpoints
into ``$JAXSPEC_HOME``, never into the installed tree.

The default set builds and installs the wheel and checks what it holds (about 6 s); the slow
tests import the installed copy from another folder and read its data, and run ``jaxspec
generate`` and ``jaxspec bench --dataset chat --prompts 1`` on the embedded default model, which
they first convert into ``$JAXSPEC_HOME`` (a few minutes on 2 cores)."""

import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = "smollm2-135m-instruct-draft"


def _package_folders() -> set[str]:
    return {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("jaxspec", "pallas_kernels")
        for p in (ROOT / top).rglob("__init__.py")
    }


def test_the_package_list_holds_every_package_folder():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    assert _package_folders() <= listed, _package_folders() - listed
    assert listed - _package_folders() == {"jaxspec.io.prompts", "jaxspec.shipped"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the install folder, an environment that runs it) from a wheel built of a copy of the
    checkout's sources (the build writes beside them, never into the checkout)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    for part in ("jaxspec", "pallas_kernels", "checkpoints/drafts"):
        shutil.copytree(ROOT / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist")],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = (tmp / "dist").glob("jaxspec-*.whl")
    target = tmp / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(target), "JAXSPEC_HOME": str(tmp / "home")}
    env.pop("JAXSPEC_COMPILE_CACHE", None)  # as a user runs it: the compilation cache on
    outside = tmp / "elsewhere"
    outside.mkdir()
    return wheel, target, env, outside


def test_the_wheel_holds_the_modules_prompt_sets_and_shipped_draft(installed):
    wheel = installed[0]
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "jaxspec").rglob("*.py")}
    modules |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "pallas_kernels").rglob("*.py")}
    assert modules <= names, sorted(modules - names)[:5]
    saved = ("humaneval", "mt_bench", "arena_hard", "ifeval")
    assert {f"jaxspec/io/prompts/{n}.json" for n in saved} <= names
    draft = {n for n in names if n.startswith(f"jaxspec/shipped/{SHIPPED}/")}
    tracked = [p for p in (ROOT / "checkpoints/drafts" / SHIPPED).rglob("*") if p.is_file()]
    assert len(draft) == len(tracked) and f"jaxspec/shipped/{SHIPPED}/draft.json" in draft
    assert not [n for n in names if n.startswith(("checkpoints/", "benchmarks/", "tests/"))]


CHECK = """
import pathlib, sys
import jaxspec
from jaxspec.io import datasets, draft_checkpoint, places
here = pathlib.Path(jaxspec.__file__).resolve()
assert here.is_relative_to(pathlib.Path(sys.argv[1]).resolve()), here
assert places.checkout() is None
assert len(datasets.load("chat", 3)[0]) == 3 and len(datasets.load("humaneval", 2)[0]) == 2
assert draft_checkpoint.is_draft_checkpoint(draft_checkpoint.SHIPPED), draft_checkpoint.SHIPPED
print(places.checkpoints(sys.argv[2]))
"""


@pytest.mark.slow  # two fresh interpreters importing JAX: ~9 s on 2 loaded cores
def test_the_installed_copy_runs_from_elsewhere_with_its_data(installed):
    _, target, env, outside = installed
    r = subprocess.run(
        [sys.executable, "-c", CHECK, str(target), env["JAXSPEC_HOME"]],
        cwd=outside, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == str(pathlib.Path(env["JAXSPEC_HOME"]) / "checkpoints")
    r = subprocess.run(
        [str(target / "bin" / "jaxspec"), "--version"], cwd=outside, env=env,
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith("jaxspec "), r.stderr[-2000:]


@pytest.mark.slow
def test_the_installed_command_generates_and_benches_the_default_model(installed):
    _, target, env, outside = installed
    jaxspec = str(target / "bin" / "jaxspec")
    run = dict(cwd=outside, env=env, capture_output=True, text=True, timeout=1800)
    r = subprocess.run([jaxspec, "generate", "Say hi.", "--max-new-tokens", "4"], **run)
    assert r.returncode == 0 and r.stdout.strip() and "tokens/s" in r.stderr, r.stderr[-3000:]
    home = pathlib.Path(env["JAXSPEC_HOME"])
    assert (home / "checkpoints" / "smollm2-135m-instruct" / "config.json").is_file()
    assert (home / "xla").is_dir()
    out = outside / "chat.json"
    argv = [jaxspec, "bench", "--dataset", "chat", "--prompts", "1", "--methods", "autoregressive"]
    argv += ["--max-new-tokens", "4", "--no-time-split", "--out", str(out)]
    r = subprocess.run(argv, **run)
    assert r.returncode == 0 and out.is_file(), r.stderr[-3000:]
    written = [p for p in target.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert not [p for p in written if p.suffix in ("", ".json") and "checkpoints" in p.parts]
