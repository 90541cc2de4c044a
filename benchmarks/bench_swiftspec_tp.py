"""SwiftSpec's iteration over N GPUs with a tensor-parallel target (issue 26): a Llama-3-70B-shape
target over x GPUs and a Llama-3-8B- or 1B-shape draft over y, random bf16 weights made on their
meshes (70B does not fit one GPU), timed by SwiftSpec's own profile (``measure.split.measure``:
one verify of bs nodes, one expansion of w leaves, the handoffs; d from them) for each x + y
split named. Random weights say nothing of acceptance, so the predicted tokens/s takes the
acceptance length measured on the real small pair (``--acceptance``; default: the tree engine
with the shipped SmolLM2 draft, w = 8, k = 4, bs = 8, on HumanEval: 2.929 tokens a verify,
benchmarks/results/spec_e2e_gpu.json) and is recorded beside SwiftSpec's 348 tok/s (Llama3-70B,
8 Hopper GPUs, ASPLOS'26).

The target runs the form the kernels name: the runner sets ``JAXSPEC_TENSOR_PARALLEL=shard_map``
(and ``JAXSPEC_ALL_REDUCE``). A 70B program compiles for minutes: one split a call.

    python benchmarks/bench_swiftspec_tp.py --splits 4+4 --out swiftspec_tp.json   # 8 GPUs
    python benchmarks/bench_swiftspec_tp.py --smoke     # CPU: tiny shapes, forced host devices
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.common import metadata  # noqa: E402
from benchmarks.shapes import LLAMA3_8B, LLAMA3_70B, LLAMA32_1B, SMOKE, SMOKE_DRAFT  # noqa: E402
from jaxspec.kernels import KernelConfig  # noqa: E402
from jaxspec.measure import split  # noqa: E402
from jaxspec.model import sharding  # noqa: E402
from jaxspec.model.transformer import Model, abstract_model, param_shapes  # noqa: E402

SHAPES = {"70b": LLAMA3_70B, "8b": LLAMA3_8B, "1b": LLAMA32_1B, "smoke": SMOKE}
SWIFTSPEC_TOK_S = 348  # Llama3-70B on 8 Hopper GPUs (SwiftSpec, arXiv 2506.11309)
REAL_PAIR_ACCEPTANCE = 2.929  # tree + shipped SmolLM2 draft, spec_e2e_gpu.json


@functools.cache
def _init(shape: tuple, dtype, where, ones: bool):
    """A jitted maker of one random (or all-ones: norms) leaf, laid out where it will live."""

    def make(key):
        if ones:
            return jnp.ones(shape, dtype)
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return jax.jit(make, out_shardings=where)


def random_placed(cfg, devices, dtype, seed: int, name: str) -> Model:
    """A model with random weights made directly in the tensor-parallel layout over ``devices``
    (no device ever holds the whole model), as ``sharding.place`` would lay it out."""
    mesh = jax.make_mesh(
        (len(devices),), (sharding.TP,), devices=devices, axis_types=(AxisType.Auto,)
    )
    specs = sharding.param_specs(cfg, mesh)
    graphdef, state = abstract_model(cfg, dtype)
    pure: dict = {}
    for i, (path, shape) in enumerate(param_shapes(cfg).items()):
        where, node = specs, pure
        for key in path:
            where = where[key]
        for key in path[:-1]:
            node = node.setdefault(key, {})
        make = _init(tuple(shape), dtype, where, path[-1] == "weight")
        node[path[-1]] = make(jax.random.key(seed * 100003 + i))
    nnx.replace_by_pure_dict(state, pure)
    return Model(cfg, graphdef, state, name=name)


def run_split(args, x: int, y: int, kernels) -> dict:
    devices = jax.devices()
    target = random_placed(SHAPES[args.target], devices[:x], args.dtype, 0, args.target)
    draft = random_placed(SHAPES[args.draft], devices[x : x + y], args.dtype, 1, args.draft)
    prompt = [int(target.config.bos_token_id or 1)] * args.context
    p = split.measure(
        target, draft, prompt, (x, y), width=args.width, branch=args.branch, bs=args.bs,
        reps=args.reps, kernels=kernels,
    )  # fmt: skip
    row = dataclasses.asdict(p) | {"iteration_ms": round(p.iteration_ms, 3)}
    row["predicted_tok_s"] = round(args.acceptance * 1e3 / p.iteration_ms, 1)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="70b", choices=SHAPES)
    ap.add_argument("--draft", default="8b", choices=SHAPES)
    ap.add_argument("--splits", default="4+4", help="x+y target+draft devices, comma separated")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--branch", type=int, default=4)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--acceptance", type=float, default=REAL_PAIR_ACCEPTANCE)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/swiftspec_tp.json")
    args = ap.parse_args()
    args.dtype = jnp.bfloat16
    if args.smoke:
        SHAPES["smoke_draft"] = SMOKE_DRAFT
        args.target, args.draft, args.dtype, args.context, args.reps = (
            "smoke", "smoke_draft", jnp.float32, 32, 2,
        )  # fmt: skip
    kernels = KernelConfig.from_env()
    out = pathlib.Path(args.out)
    payload = json.loads(out.read_text()) if out.is_file() else {**metadata(), "rows": []}
    payload.update(
        swiftspec_paper_tok_s=SWIFTSPEC_TOK_S, acceptance=args.acceptance,
        acceptance_from="tree + shipped SmolLM2 draft, spec_e2e_gpu.json (real small pair)",
    )  # fmt: skip
    for text in args.splits.split(","):
        x, y = (int(v) for v in text.split("+"))
        try:
            row = run_split(args, x, y, kernels)
        except Exception as e:  # recorded; the next split still runs
            row = {"target_devices": x, "draft_devices": y, "error": f"{type(e).__name__}: {e}"}
        row.update(target=args.target, draft=args.draft, context=args.context,
                   kernels=kernels.describe())  # fmt: skip
        payload["rows"].append(row)
        done = [r for r in payload["rows"] if "predicted_tok_s" in r]
        if done:
            best = max(done, key=lambda r: r["predicted_tok_s"])
            payload["best"] = {k: best[k] for k in ("target_devices", "draft_devices", "d")}
            payload["best_predicted_tok_s"] = best["predicted_tok_s"]
            payload["best_iteration_ms"] = best["iteration_ms"]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2) + "\n")
        print(json.dumps(row)[:600], flush=True)


if __name__ == "__main__":
    main()
