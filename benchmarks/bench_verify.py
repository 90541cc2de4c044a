"""What a verification costs against a decode step, measured through the engines' own units.

    python benchmarks/bench_verify.py [--shape smol|1b] [--context 1024] [--out verify.json]

Random bf16 weights of a model shape, batch 1, one prompt of ``--context`` tokens. Each figure is
an engine's unit (``Engine.units``) timed by ``measure.units`` at the prompt's context, steps back
to back on the device:

- ``decode_ms``: the autoregressive engine's decode step (1 token);
- ``chain_verify_ms[g]``: the chain engine's verify of g + 1 tokens (the target and the rule);
- ``tree_verify_ms``: the tree engine's verify of bs + 1 = 9 tree nodes and its path commit (the
  same number of queries as a gamma-8 chain verify, so the difference is the tree mask and the
  commit's K/V moves);
- ``verify16_over_decode``: a 16-token verify (gamma 15) over a decode step.

The kernels are the defaults of this backend, or what the ``JAXSPEC_*`` variables set (one
process per setting: ``JAXSPEC_FUSED_COMMIT=off`` measures the tree commit without its kernel).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import jaxspec  # noqa: E402
from benchmarks.shapes import LLAMA32_1B, SMOKE, SMOLLM2_135M  # noqa: E402
from jaxspec.measure import units  # noqa: E402
from jaxspec.model.transformer import truncate  # noqa: E402
from jaxspec.provenance import metadata  # noqa: E402

SHAPES = {"smol": SMOLLM2_135M, "1b": LLAMA32_1B, "smoke": SMOKE}


def unit_ms(target, ids, method, draft, unit, reps, **options) -> float:
    call = jaxspec.api.prepare(target, ids, method=method, draft=draft, max_new_tokens=4, **options)
    tflat = target.flat
    dflat = None if call.draft is None else call.draft.flat
    s = units.initial(call.engine, call.prog, tflat, dflat, call.ids, call.lens)
    return units.unit_ms(call.engine.units(call.prog)[unit], call.prog, tflat, dflat, s, reps=reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=tuple(SHAPES), default="smol")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--label", default="defaults")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = SHAPES[args.shape]
    gpu = jax.default_backend() == "gpu"
    target = jaxspec.new_model(cfg, seed=0, dtype=jnp.bfloat16 if gpu else jnp.float32)
    target.kernels = jaxspec.KernelConfig.from_env()
    draft = truncate(target, 1)
    ids = np.random.RandomState(0).randint(4, cfg.vocab_size, (1, args.context - 8)).tolist()
    row = {"label": args.label, "shape": args.shape, "context": args.context}
    row["decode_ms"] = unit_ms(target, ids, "autoregressive", None, "verify", args.reps)
    row["chain_verify_ms"] = {
        g: unit_ms(target, ids, "chain", draft, "verify", args.reps, gamma=g) for g in (4, 8, 15)
    }
    row["tree_verify_ms"] = unit_ms(target, ids, "tree", draft, "verify", args.reps)
    row["tree_over_chain_verify"] = round(row["tree_verify_ms"] / row["chain_verify_ms"][8], 3)
    row["verify16_over_decode"] = round(row["chain_verify_ms"][15] / row["decode_ms"], 3)
    row["kernels"] = target.net().kernels.describe()
    print(json.dumps(row), flush=True)
    if args.out:
        path = pathlib.Path(args.out)
        payload = json.loads(path.read_text()) if path.is_file() else {**metadata(), "rows": []}
        payload["rows"].append(row)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
