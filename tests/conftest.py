"""Test set-up: 8 forced host devices, CPU only (unless JAX_PLATFORMS says otherwise), float32
matmuls, and jaxtyping's runtime shape checks (beartype) on every jaxspec and pallas_kernels
module."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On the CPU the suite's time is XLA's compiles, and most of a compile is LLVM's optimization of
# the generated code: at level 0 tests/test_loop_chunk.py and tests/test_chain.py took 86 s
# against 106 s (one process, 2-core machine, 2026-12-03). The tests compare programs compiled
# alike (and the CLI's subprocesses inherit the flag); the GPU runs of the tests keep XLA's default.
CPU_FLAGS = "--xla_force_host_platform_device_count=8"
if os.environ["JAX_PLATFORMS"] == "cpu":
    CPU_FLAGS += " --xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", CPU_FLAGS)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the CLI's persistent compilation cache stays off in the test process (tests that check it run
# the CLI in a subprocess without this)
os.environ.setdefault("JAXSPEC_COMPILE_CACHE", "off")
# the CLI's per-user folder (converted checkpoints, JAX's compilation cache): a fresh one per
# session, never the user's own, removed at exit
if "JAXSPEC_HOME" not in os.environ:
    import atexit  # noqa: E402
    import shutil  # noqa: E402
    import tempfile  # noqa: E402

    os.environ["JAXSPEC_HOME"] = tempfile.mkdtemp(prefix="jaxspec-test-home-")
    atexit.register(shutil.rmtree, os.environ["JAXSPEC_HOME"], ignore_errors=True)

import importlib  # noqa: E402
import pkgutil  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

try:
    import beartype  # noqa: E402, F401

    CHECKER = "beartype.beartype"
except ImportError:
    # The lent GPU machines have no beartype and no pip: there the tests (JAX_PLATFORMS=cuda)
    # run without the runtime shape checks. CI and this machine install it (the test extra).
    if os.environ.get("CI"):
        raise
    import warnings  # noqa: E402

    warnings.warn("beartype is not installed: no runtime shape checks", stacklevel=1)
    CHECKER = None

with install_import_hook(["jaxspec", "pallas_kernels"], CHECKER):
    for package in ("jaxspec", "pallas_kernels"):
        pkg = importlib.import_module(package)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}."):
            importlib.import_module(info.name)

from jaxspec.engines import programs  # noqa: E402


@pytest.fixture(autouse=True)
def _no_persistent_compile_cache():
    """No test may leave JAX's persistent compilation cache on for the tests after it (a CLI
    call in-process with the suite's JAXSPEC_COMPILE_CACHE=off cleared turns it on, and then
    every later compile of that process writes to disk: one such write crashed a worker)."""
    yield
    on = jax.config.jax_compilation_cache_dir
    if on:
        jax.config.update("jax_compilation_cache_dir", None)
        pytest.fail(f"this test turned JAX's persistent compilation cache on ({on})")


# The suite's program cache holds more programs than a user's process keeps (64): one worker
# runs hundreds of tests over the same tiny shapes, and a program dropped there is compiled again
# by a later test (seconds each on a CPU).
SUITE_PROGRAMS = 256


@pytest.fixture(autouse=True)
def _programs_outlive_a_clearing_test():
    """A test that empties the program cache (so that its spies see fresh traces) gets the
    programs compiled before it back when it ends, as they were: the tests after it do not
    compile them again (eight files clear it). What the test compiled itself stays too, unless it
    removed it."""
    programs.MAX_PROGRAMS = SUITE_PROGRAMS
    before = list(programs._COMPILED.items())
    yield
    if len(before) and any(k not in programs._COMPILED for k, _ in before):
        with programs._COMPILE_LOCK:
            for k, exe in before:
                programs._COMPILED[k] = exe
            while len(programs._COMPILED) > programs.MAX_PROGRAMS:
                programs._COMPILED.popitem(last=False)
