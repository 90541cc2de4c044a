"""Programs kept on disk (``jaxspec.engines.executables``): a later compile of the same program
loads it without tracing, another program is never taken for it, and what cannot be described
exactly is never kept."""

import contextlib
import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.engines import ENGINES, executables, programs

LOADS = []


@dataclasses.dataclass(frozen=True)
class Scale:
    factor: float
    label: str = "x"


def _scaled(static: Scale, x):
    return jnp.sin(x) * static.factor


@pytest.fixture(autouse=True)
def _loads(monkeypatch):
    """Each look in the store, as ``LOADS``: whether it found the program (JAX keeps compiled
    programs of its own within a process, so counting XLA compiles cannot tell)."""
    LOADS.clear()
    load = executables.load

    def spy(where, name):
        exe = load(where, name)
        LOADS.append(exe is not None)
        return exe

    monkeypatch.setattr(executables, "load", spy)


@contextlib.contextmanager
def _store(folder):
    """JAX's persistent cache on in ``folder`` (and so the store in ``folder/jaxspec``)."""
    jax.config.update("jax_compilation_cache_dir", str(folder))
    try:
        yield folder / "jaxspec"
    finally:
        jax.config.update("jax_compilation_cache_dir", None)


def _compile(static, x):
    """``programs.compiled`` as if this process had never compiled ``static`` (not in memory)."""
    for full in [k for k in programs._COMPILED if k[0] is _scaled]:
        del programs._COMPILED[full]
    return programs.compiled(_scaled, static, (x,), programs.shapes_key(x))[0]


def test_a_kept_program_is_read_back_by_a_later_compile(tmp_path):
    x = jnp.asarray(np.random.RandomState(1).randn(7).astype(np.float32))
    with _store(tmp_path) as kept:
        first = _compile(Scale(3.0), x)
        assert LOADS == [False] and len(list(kept.glob("*.exe"))) == 1
        again = _compile(Scale(3.0), x)
        assert LOADS == [False, True] and again is not first
        np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(first(x)))
        np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(jnp.sin(x) * 3.0))
        _compile(Scale(3.0, "y"), x)  # another static program: its own
        four = _compile(Scale(4.0), x)
        assert LOADS == [False, True, False, False] and len(list(kept.glob("*.exe"))) == 3
        np.testing.assert_array_equal(np.asarray(four(x)), np.asarray(jnp.sin(x) * 4.0))
        _compile(Scale(3.0), x[:5])  # other shapes: another program
        assert LOADS[-1] is False and len(list(kept.glob("*.exe"))) == 4


def test_compile_all_reads_kept_programs_and_compiles_only_the_rest(tmp_path):
    """``compile_all`` (MagicDec's measuring) keeps what it compiles in the store, and a later
    process finds it there: it reads those first and says "compiling" of the others only."""
    x = jnp.asarray(np.random.RandomState(2).randn(6).astype(np.float32))

    def jobs(*factors):
        return [
            programs.Job(_scaled, Scale(f), (x,), programs.shapes_key(x), what=f"x{f}")
            for f in factors
        ]

    def forget():
        for full in [k for k in programs._COMPILED if k[0] is _scaled]:
            del programs._COMPILED[full]

    said = []
    with _store(tmp_path) as kept:
        forget()
        programs.compile_all(jobs(5.0, 6.0), workers=2, progress=said.append)
        assert LOADS == [False, False] and len(list(kept.glob("*.exe"))) == 2
        assert said == ["compiling 2 programs on 2 threads: x5.0; x6.0"]
        forget()
        said.clear()
        programs.compile_all(jobs(5.0, 7.0, 6.0), workers=2, progress=said.append)
        assert LOADS[2:] == [True, False, True] and said == ["compiling x7.0"]
        for f in (5.0, 6.0, 7.0):
            exe = programs._COMPILED[jobs(f)[0].full]
            np.testing.assert_array_equal(np.asarray(exe(x)), np.asarray(jnp.sin(x) * f))


def test_a_found_program_keeps_the_seconds_its_build_took():
    """``compile_all`` says what a call spent (0 for a program found), ``built_seconds`` what the
    program took to build whenever it was built (MagicDec prices another gamma's loop by its
    own); a program dropped from memory has none."""
    x = jnp.asarray(np.random.RandomState(3).randn(5).astype(np.float32))
    job = programs.Job(_scaled, Scale(float(np.random.RandomState(4).rand())), (x,),
                       programs.shapes_key(x))  # fmt: skip
    assert programs.built_seconds(job) == 0.0
    (spent,) = programs.compile_all([job])
    assert spent > 0 and programs.built_seconds(job) == spent
    assert programs.compile_all([job]) == [0.0] and programs.compiled(
        _scaled, job.static, (x,), job.key
    )[1] == 0.0  # fmt: skip
    assert programs.built_seconds(job) == spent
    del programs._COMPILED[job.full]
    assert programs.built_seconds(job) == 0.0
    _, again = programs.compiled(_scaled, job.static, (x,), job.key)
    assert again > 0 and programs.built_seconds(job) == again


def test_a_damaged_kept_program_is_compiled_again(tmp_path):
    x = jnp.arange(4, dtype=jnp.float32)
    with _store(tmp_path) as kept:
        _compile(Scale(2.0), x)
        (path,) = kept.glob("*.exe")
        path.write_bytes(path.read_bytes()[:100])
        exe = _compile(Scale(2.0), x)
        assert LOADS == [False, False] and path.stat().st_size > 100
        np.testing.assert_array_equal(np.asarray(exe(x)), np.asarray(jnp.sin(x) * 2.0))
        _compile(Scale(2.0), x)
        assert LOADS == [False, False, True]


_PROCESS = """
import sys
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from jaxspec.engines import programs
from tests.test_executables import Scale, _scaled
x = jnp.arange(5, dtype=jnp.float32)
jax.jit(lambda a: a + 1)(x)  # JAX's cache is looked at before any keep, as loading a model does
if sys.argv[2] == "jax":  # only JAX's own cache gets the program
    jax.jit(_scaled, static_argnums=0).lower(Scale(6.0), x).compile()
else:  # the store keeps it (first) or has it (then)
    exe, _ = programs.compiled(_scaled, Scale(6.0), (x,), programs.shapes_key(x))
    print(np.asarray(exe(x)).tolist())
"""


def test_a_program_jax_already_holds_is_kept_from_a_fresh_compile(tmp_path):
    """A program to keep is compiled anew even when JAX's persistent cache holds it (as after a
    jaxspec upgrade: the same program under a new name). On a CPU an executable JAX read back
    from its cache serializes without its compiled functions: kept, it failed to run in the
    next process ("Function ... not found"). Three processes: JAX's cache, keep, read back."""

    def process(step):
        r = subprocess.run(
            [sys.executable, "-c", _PROCESS, str(tmp_path), step],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=pathlib.Path(__file__).parent.parent,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout

    want = (np.sin(np.arange(5, dtype=np.float32)) * np.float32(6.0)).tolist()
    process("jax")
    assert not (tmp_path / "jaxspec").exists()
    kept = process("keep")
    assert len(list((tmp_path / "jaxspec").glob("*.exe"))) == 1
    assert kept == process("again")
    np.testing.assert_allclose(eval(kept), want, rtol=1e-6)


def test_without_the_persistent_cache_nothing_is_kept(tmp_path):
    assert executables.folder() is None
    x = jnp.ones(3)
    _compile(Scale(5.0), x)
    _compile(Scale(5.0), x)
    assert LOADS == []


def test_only_exact_descriptions_make_a_key():
    d = executables.describe
    assert d(Scale(0.1)) == d(Scale(0.1)) != d(Scale(0.1 + 1e-17 + 2**-56))
    assert d((1, "a", None, 2.5, True)) != d((1, "a", None, 2.5, 1))
    assert "Autoregressive" in d(ENGINES["autoregressive"])
    assert d(np.float32(1.5)) != d(np.float64(1.5)) != d(1.5)
    for bad in (lambda s, x: x, np.zeros(3), object(), jax.devices()[0]):
        with pytest.raises(executables.Unstable):
            d(bad)
    assert executables.digest(lambda s, x: x, Scale(1.0), (), (), {}) is None
    assert executables.digest(_scaled, Scale(1.0), (), (), {}) != executables.digest(
        _scaled, Scale(1.0), (), (0,), {}
    )


def test_a_sharding_is_described_with_its_devices():
    devices = jax.devices()  # the suite forces eight host devices
    a = NamedSharding(jax.make_mesh((2,), ("tp",), devices=devices[:2]), P("tp"))
    b = NamedSharding(jax.make_mesh((2,), ("tp",), devices=devices[2:4]), P("tp"))
    assert repr(a) == repr(b)  # what JAX prints cannot tell them apart
    d = executables.describe
    assert d(a) != d(b) and d(a.mesh) != d(b.mesh)
    assert d(a) == d(NamedSharding(jax.make_mesh((2,), ("tp",), devices=devices[:2]), P("tp")))
