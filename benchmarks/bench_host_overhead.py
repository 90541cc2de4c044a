"""Host time of a warm ``jaxspec.generate`` call outside the engine's device work.

    python benchmarks/bench_host_overhead.py [--shape smollm2|smollm2-narrow] [--new 128]
        [--reps 20] [--out benchmarks/results/host_overhead.json] [--keep-other-devices]
        [--no-tune-host] [--long-prompt 4096] [--long-reps 10]

For each method (autoregressive, chain with prompt lookup, tree with a 2-layer draft) one
prompt of 64 token ids is decoded ``--reps`` times after two warm-up calls (compiles excluded),
and each call is split in two:

- ``engine_ms``: the engine's own ``stats.wall_s``: from the dispatch of its compiled program to
  its outputs on the host (``engines.base.on_device``: the executable call, the device work, the
  device-to-host copy). The engines run their whole loop as one program, so this is the device
  work plus one dispatch and one transfer;
- ``outside_ms``: the wall clock of the whole ``generate()`` call minus ``engine_ms``: option
  parsing, prompt encoding and padding, the compile-cache lookup, trimming, stats.

The first token after a long prompt (``--long-prompt`` ids, one new token, autoregressive,
``--long-reps`` calls) is timed the same way, with the prompt given as a list of ids and as a
numpy array: the host work that grows with the prompt (its ids checked and packed) is part of
the latency issue's first-token figure.

Once the model is built the process calls ``jaxspec.tune_host()``, as ``jaxspec bench`` does
once its model is loaded (``--no-tune-host``: not;
``jaxspec/host.py`` says what it changes and why). Rows hold the medians over the
repetitions. ``smollm2`` is SmolLM2-135M's shape (30 layers, the real number of weight leaves,
which is what a call's host work scales with); ``smollm2-narrow`` the same layers and leaves at
width 64 (the CPU default: the same host work, a fast device part). Weights are random:
acceptance is irrelevant here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec.config import ModelConfig
from jaxspec.model.transformer import truncate
from jaxspec.provenance import metadata

SMOLLM2 = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
    tie_word_embeddings=True,
)  # fmt: skip
SHAPES = {
    "smollm2": SMOLLM2,
    "smollm2-narrow": dataclasses.replace(
        SMOLLM2,
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
    ),  # fmt: skip
}
METHODS = (
    ("autoregressive", None, {}),
    ("chain", "ngram", {"gamma": 4}),
    ("tree", "draft", {}),
)


def one_call(target, ids, method, draft, options, new):
    t0 = time.perf_counter()
    r = jaxspec.generate(target, ids, method=method, draft=draft, max_new_tokens=new, **options)
    wall = time.perf_counter() - t0
    return wall * 1e3, r.stats["wall_s"] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu = jax.default_backend() == "gpu"
    ap.add_argument(
        "--shape", choices=tuple(SHAPES), default="smollm2" if gpu else "smollm2-narrow"
    )
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--keep-other-devices",
        action="store_true",
        help="keep --out's rows of other devices (each row names its device and commit): one "
        "file for the CPU and the H200 runs",
    )
    ap.add_argument("--long-prompt", type=int, default=4096, help="0: no long-prompt rows")
    ap.add_argument("--long-reps", type=int, default=10)
    ap.add_argument(
        "--no-tune-host",
        action="store_true",
        help="leave the process's allocator as it is (jaxspec.tune_host not called)",
    )
    args = ap.parse_args()
    cfg = SHAPES[args.shape]
    dtype = jnp.bfloat16 if gpu else jnp.float32
    target = jaxspec.new_model(cfg, seed=0, dtype=dtype)
    target.kernels = jaxspec.KernelConfig.from_env()
    small = truncate(target, 2)
    tuned = False if args.no_tune_host else jaxspec.tune_host()
    ids = np.random.RandomState(0).randint(4, cfg.vocab_size, (1, 64)).tolist()
    meta = metadata()
    device = meta["device"]
    rows = []
    cases = [(m, d, o, ids, "list", args.new, args.reps) for m, d, o in METHODS]
    if args.long_prompt:
        long = np.random.RandomState(1).randint(4, cfg.vocab_size, (1, args.long_prompt))
        for given, prompt in (("list", long.tolist()), ("array", long)):
            cases.append(("autoregressive", None, {}, prompt, given, 1, args.long_reps))
    for method, draft, options, prompt, given, new, reps in cases:
        d = small if draft == "draft" else draft
        for _ in range(2):  # compile, then one warm call
            one_call(target, prompt, method, d, options, new)
        walls, engines = zip(
            *(one_call(target, prompt, method, d, options, new) for _ in range(reps)),
            strict=True,
        )
        outside = [w - e for w, e in zip(walls, engines, strict=True)]
        row = {
            "device": device,
            "commit": meta["commit"],
            "method": method,
            "draft": draft,
            "prompt_tokens": int(np.asarray(prompt).size),
            "prompt_as": given,
            "new_tokens": new,
            "outside_ms": round(statistics.median(outside), 4),
            "outside_ms_p90": round(float(np.percentile(outside, 90)), 4),
            "wall_ms": round(statistics.median(walls), 4),
            "engine_ms": round(statistics.median(engines), 4),
            "tune_host": tuned,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.keep_other_devices and args.out and pathlib.Path(args.out).is_file():
        old = json.loads(pathlib.Path(args.out).read_text())
        kept = [{"commit": old.get("commit"), **r} for r in old.get("rows", [])]
        rows = [r for r in kept if r["device"] != device] + rows
    result = {
        **meta,
        "shape": args.shape,
        "new_tokens": args.new,
        "reps": args.reps,
        "kernels": target.net().kernels.describe(),
        "how": "outside_ms = wall of generate() - stats.wall_s (the engine's program from "
        "dispatch to outputs on the host); medians over reps after two warm-up calls",
        "rows": rows,
    }
    if args.out:
        path = pathlib.Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'method':>15} {'prompt':>12} {'outside ms':>11} {'engine ms':>10} {'wall ms':>9}")
    for r in rows:
        given = f"{r.get('prompt_tokens', 64)} {r.get('prompt_as', 'list')}"
        line = f"{r['method']:>15} {given:>12} {r['outside_ms']:>11.3f} {r['engine_ms']:>10.2f}"
        print(f"{line} {r['wall_ms']:>9.2f}")


if __name__ == "__main__":
    main()
