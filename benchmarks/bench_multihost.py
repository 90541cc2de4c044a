"""One ``jaxspec generate`` as two processes of one job on 127.0.0.1 beside the same command in
one process (issue #25): what the multi-controller runtime and the cross-process collectives
cost on this machine. No speed claim: on CPU both processes share the same cores.

    python benchmarks/bench_multihost.py [--model CKPT] [--tp 3] [--new 32]
        [--methods autoregressive,chain] [--out benchmarks/results/multihost.json]

Each row is one command line, run as a fresh process (or as ``jaxspec launch -n 2
--devices-per-process 2``), with the same tokens asked for:

- ``1 process, 1 device``: ``jaxspec generate PROMPT --raw`` with one CPU device;
- ``1 process, tp N``: the same with ``--tp N`` over N devices of one process;
- ``2 processes, tp N``: ``jaxspec launch -n 2 --devices-per-process 2 -- generate ... --tp N``:
  the target's mesh is the first N devices of both processes (for N = 3: two of process 0's,
  one of process 1's), its all-reduces cross the processes.

``engine_s`` is the generate's own wall (``stats.wall_s``, compile excluded, as the command
prints it), ``process_s`` the command's whole wall (start, load, compile, generate); the tokens
of every row are checked to be the 1-device row's.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import time

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import common

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):"
STATS = re.compile(
    r"\[(\w+)\] (\d+) tokens in ([\d.]+) s = .*acceptance length ([\d.]+); compile ([\d.]+) s"
)


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXSPEC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def one(setup: str, cmd: list[str], devices: int) -> dict:
    """Run one command line; its printed text and stats, and its wall."""
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "jaxspec.cli", *cmd],
        env=_env(devices),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    m = STATS.search(r.stderr)
    if r.returncode != 0 or m is None:
        raise SystemExit(f"{setup} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return {
        "setup": setup,
        "method": m.group(1),
        "new_tokens": int(m.group(2)),
        "engine_s": float(m.group(3)),
        "acceptance_length": float(m.group(4)),
        "compile_s": float(m.group(5)),
        "process_s": round(wall, 2),
        "text": r.stdout.strip(),
    }


def rows(args) -> list[dict]:
    out = []
    for method in args.methods.split(","):
        gen = ["generate", PROMPT, "--raw", "--model", args.model, "--method", method]
        gen += ["--max-new-tokens", str(args.new)]
        if method != "autoregressive":
            gen += ["--draft", "ngram"]
        tp = ["--tp", str(args.tp)]
        launch = ["launch", "-n", "2", "--devices-per-process", "2", "--"]
        group = [
            one("1 process, 1 device", gen, 1),
            one(f"1 process, tp {args.tp}", gen + tp, args.tp),
            one(f"2 processes, tp {args.tp}", launch + gen + tp, 2),
        ]
        for row in group:
            row["same_text"] = row["text"] == group[0]["text"]
            print({k: v for k, v in row.items() if k != "text"}, flush=True)
        out += group
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    ap.add_argument("--tp", type=int, default=3, help="SmolLM2-135M: 9 heads, 3 kv heads")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--methods", default="autoregressive,chain")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    found = rows(args)
    for row in found:
        row.pop("text")
    payload = {
        **common.metadata(),
        "device": "CPU, 2 processes on one machine (127.0.0.1)",
        "model": pathlib.Path(args.model).name,
        "prompt": PROMPT,
        "how": "one command line a row, a fresh process (or 2 through jaxspec launch); "
        "engine_s = the generate's stats.wall_s (compile excluded), process_s = the whole "
        "command; float32; the processes share this machine's cores: no speed claim",
        "rows": found,
    }
    common.write("multihost.json", payload, args.out)


if __name__ == "__main__":
    main()
