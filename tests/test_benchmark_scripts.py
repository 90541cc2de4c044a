"""Every benchmark script runs as RESULTS.md writes its command, ``python benchmarks/X.py``, from
any folder: 18 of them imported ``benchmarks.common`` with only their own folder on the path
(which works where PYTHONPATH holds the repository, as on the GPU machines, and nowhere else)."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p.name
    for p in (REPO / "benchmarks").glob("*.py")
    if 'if __name__ == "__main__":' in p.read_text()
)

# One process for all (jax imports once): each script as ``python`` runs a file, its folder first
# on the path and nothing of the repository's imported, then ``--help``.
CHECK = """
import runpy, sys
root, folder, names = sys.argv[1], sys.argv[2], sys.argv[3:]
base = [p for p in sys.path if p not in (root, "", ".")]
failed = []
for name in names:
    sys.path[:] = [folder, *base]
    for mod in [m for m in sys.modules if m.split(".")[0] in ("benchmarks", "tests")]:
        del sys.modules[mod]
    sys.argv = [f"{folder}/{name}", "--help"]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            failed.append(f"{name}: exit {e.code}")
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print("FAILED " + " | ".join(failed) if failed else "ok")
"""


def test_every_benchmark_script_runs_from_another_folder(tmp_path):
    assert len(SCRIPTS) > 20
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run(
        [sys.executable, "-c", CHECK, str(REPO), str(REPO / "benchmarks"), *SCRIPTS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "ok", r.stdout[-3000:]
