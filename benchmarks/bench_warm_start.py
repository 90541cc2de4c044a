"""What a user waits for at the command line: ``jaxspec generate`` of 12 tokens with the embedded
default model, in fresh processes, the first with an empty per-user folder (compiles, fills
JAX's persistent compilation cache) and then warm (reads it), against ``--no-compile-cache``;
and ``--method magicdec`` with ``gamma="auto"``, first measuring its cost model, then reusing
the kept profile. Each row is a whole process, import to exit, as ``time`` shows it; a run
that measures the cost model also gives ``measuring_s``, from its "measuring" message to the
first piece of its answer on stdout (the measuring, then the run's first segment).

    .venv/bin/python benchmarks/bench_warm_start.py [--repeats 2] [--magicdec-series 1]
        [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.common import metadata, write  # noqa: E402

PROMPT = "Say hi."
GENERATE = ["generate", PROMPT, "--max-new-tokens", "12"]
MAGICDEC = [*GENERATE, "--method", "magicdec", "--draft", "self-streaming"]


def run(argv: list[str], home: str) -> dict:
    """One process: its wall seconds, what its last line said (compile seconds) and, when it
    measured a cost model, the seconds from its "measuring" message to its first output."""
    env = {**os.environ, "JAXSPEC_HOME": home}
    env.pop("JAXSPEC_COMPILE_CACHE", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [sys.executable, "-m", "jaxspec.cli", *argv], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[tuple[float, str]] = []  # stderr's lines as they come, with their times
    reader = threading.Thread(
        target=lambda: lines.extend((time.perf_counter(), line) for line in p.stderr)
    )
    reader.start()
    first = p.stdout.read(1)  # the first piece of the answer
    first_s = time.perf_counter()
    p.stdout.read()
    p.wait()
    reader.join()
    wall = time.perf_counter() - t0
    err = "".join(line for _, line in lines)
    if p.returncode or not first:
        raise SystemExit(f"{' '.join(argv)} failed:\n{err[-3000:]}")
    compile_s = re.search(r"compile ([\d.]+) s", err)
    measuring = [t for t, line in lines if line.startswith("measuring MagicDec")]
    return {
        "wall_s": round(wall, 2),
        "compile_s": float(compile_s.group(1)) if compile_s else None,
        "measured": bool(measuring),
        "measuring_s": round(first_s - measuring[0], 2) if measuring else None,
    }


def series(name: str, argv: list[str], repeats: int) -> list[dict]:
    """A cold run into a fresh folder, then ``repeats`` warm ones reading it."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxspec-warm-") as home:
        for i in range(repeats + 1):
            row = {"case": name, "run": "cold" if i == 0 else "warm", **run(argv, home)}
            print(row, flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--magicdec-series", type=int, default=1,
        help="magicdec series (a cold run that measures, a warm one), each in a fresh folder",
    )  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = series("generate", GENERATE, args.repeats)
    rows += series("generate --no-compile-cache", [*GENERATE, "--no-compile-cache"], 1)
    for _ in range(args.magicdec_series):
        rows += series("generate --method magicdec (gamma auto)", MAGICDEC, 1)
    warm = [r["wall_s"] for r in rows if r["case"] == "generate" and r["run"] == "warm"]
    measuring = [r["measuring_s"] for r in rows if r["measuring_s"] is not None]
    write(
        "warm_start_cpu.json",
        {
            **metadata(),
            "prompt": PROMPT,
            "max_new_tokens": 12,
            "warm_start_s": round(statistics.median(warm), 2),
            "magicdec_measuring_s": round(statistics.median(measuring), 2),
            "rows": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
