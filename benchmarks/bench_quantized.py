"""Quantized weights (issue 22): decode steps against the bf16 step of the same run and against
their own HBM floor, the dequantizing kernel's tiles, and the real SmolLM2-135M Q4_1 kept
quantized against dequantized.

    python benchmarks/bench_quantized.py --out quantized.json              # every section
    python benchmarks/bench_quantized.py --sections real --out cpu.json    # what runs on a CPU
    python benchmarks/bench_quantized.py --smoke                           # tiny shapes (CPU)

Sections, in this order (each appends to ``--out`` as it ends; past ``--budget-s`` the rest is
skipped and says so):

- ``check``: a 4-layer SmolLM2-shape model in float32, its projections Q4_1-style: greedy tokens
  with the GPU defaults (dequantizing split-K projection kernels) equal the XLA path's
  (``quant_matmul="xla"``, no fused kernels), and the dequantizing kernel's products equal
  dequantize-then-matmul for int8 / int4 (max relative error); on a Hopper GPU the same for
  the WGMMA kernel (``quant_wgmma``, against the float32 dequantize-then-matmul), bf16 rows,
  with bf16 and float32 scales, at 1, 8, 13 rows.
- ``sweep``: ``qmatmul`` alone on Llama-3-8B's gate/up (4096 x 14336) and down (14336 x 4096)
  projections, at 8 rows (the model pads a decode step's stream to 8 on a GPU) and at 1 (the
  kernel pads every step to 16 tensor-core rows), int8 and int4, for each tile of ``TILES``:
  microseconds and GB/s of the bytes read, each loop cycling through ``COPIES`` distinct
  weights (one weight re-read would come from L2); the tile with the least total time per
  ``"bits:rows"`` (``best_tile``) is the one ``steps`` uses (its ``"bits:8"``). Beside them, per
  bits and rows, the XLA path on the same shapes (``quant.dequantize`` to bf16, then ``jnp.dot``,
  in one jitted loop: XLA may fuse the convert into its GEMM; GB/s of the packed bytes), and a
  bf16 ``jnp.dot`` of the dense weights (GB/s of their bf16 bytes): the floor the quantized
  kernels must beat. At 8 rows also the WGMMA kernel (``quant_wgmma``, K-major codes, bf16
  scales) for each of ``WGMMA_TILES``.
- ``steps``: ``bench_decode_gpu.run_case`` (one jitted loop of decode steps, cache donated) on
  Llama-3-8B at B=1, 4K: bf16, int8 (a scale per channel) and int4 (groups of 128), bf16
  scales (on a Hopper GPU laid out for the WGMMA kernel, ``quantized.for_wgmma``), each also
  through the XLA path (``+xla``: ``KernelConfig(quant_matmul="xla")``); then the SmolLM2-135M
  shape at B=1, 1K: bf16 and its GGUF layout (Q4_1 layers, Q8_0 embedding). The floor is the
  bytes as stored (codes, scales, mins) plus the K/V in view, over 4.3 TB/s.
- ``real``: the real SmolLM2-135M-Instruct (its GGUF: ``JAXSPEC_DEFAULT_GGUF`` or the installed
  package), autoregressive ``generate()`` of ``--new`` tokens at B=1 on a chat prompt, kept
  quantized against dequantized at load (bf16 on a GPU; float32 and bf16 on a CPU).

The JSON keeps one section per device, ``gpu`` and ``cpu`` (a run replaces its own and keeps
the other's: the GPU runner starts from the committed file). On top: the metadata of the last
run, the GPU section's ``int8_over_bf16_8b`` and ``int4_over_bf16_8b`` (step-time ratios of one
run; ``..._xla_over_bf16_8b`` for the ``+xla`` rows), ``int8_of_floor_8b`` / ``int4_of_floor_8b``
(floor over step), ``smol_q4_1_over_bf16``
(the random-weight SmolLM2 step) and ``real_q4_1_over_bf16_tok_per_s`` (the real model kept
quantized over dequantized to bf16), and ``rows``: every measurement of both sections with its
float baseline of the same run beside it (steps: kernels per layer too).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_decode_gpu import SHAPES, Case, quantized_twin, run_case  # noqa: E402
from benchmarks.common import metadata  # noqa: E402
from jaxspec.api import generate  # noqa: E402
from jaxspec.io.convert import load  # noqa: E402
from jaxspec.io.default_model import default_checkpoint  # noqa: E402
from jaxspec.kernels import KernelConfig  # noqa: E402
from jaxspec.model.transformer import new_model  # noqa: E402
from jaxspec.timing import loop_ms, repeat  # noqa: E402
from pallas_kernels import quant, quant_linear, quant_wgmma  # noqa: E402

SECTIONS = ("check", "sweep", "steps", "real")
# (BN, BK, K splits, warps, stages), K splits by quant_linear.plan: the two H200 sweeps of the
# scale-row kernel (2026-12-03, benchmarks/notes/quantized.md) put every 256-wide tile within
# ~10% of another; these are their winners. A one-row kernel that accumulated its products in
# registers (no tensor cores) was 1.4-2.5x slower than the padded tile on every tile tried
# (2026-12-06, f48fdbb, notes), and is gone.
TILES = (
    (256, 64, None, 4, 4),
    (256, 128, None, 4, 3),
)
# (bk, stages, K splits, channels a warpgroup) of quant_wgmma (the Mosaic GPU kernel; None: its
# defaults), per bits; its weights with bf16 scales, as `convert --quantize` stores them for bf16.
# The H200 moves more bytes than the H100 with as many SMs, so more stages (bytes in flight a
# program) and fewer K splits (fewer pipeline fills) sit beside the H100's winners.
WGMMA_TILES = {
    8: (
        (None, None, None, None), (256, 3, None, 64), (256, 2, None, 128), (512, 2, None, 64),
        (256, 4, None, 64), (256, 3, None, 128), (256, 2, 2, 64),
    ),
    4: (
        (None, None, None, None), (128, 4, None, 64), (128, 4, None, 128), (128, 2, None, 128),
        (128, 5, None, 128), (128, 3, 2, 128),
    ),
}  # fmt: skip
COPIES = 4  # distinct weights a timed loop cycles through: 4 x 29 MB of int4 codes outgrow L2
SWEEP_SHAPES = {"gate_up": (4096, 14336), "down": (14336, 4096)}  # (K, N), 8B's MLP
XLA = "+xla"  # a step case's suffix: its projections through KernelConfig(quant_matmul="xla")
STEP_CASES = (
    "8b:1:4096:1", "8b:1:4096:1:1:int8", "8b:1:4096:1:1:int4",
    "8b:1:4096:1:1:int8" + XLA, "8b:1:4096:1:1:int4" + XLA,
)  # fmt: skip
SMOL_CASES = ("smol:1:1024:1", "smol:1:1024:1:1:q4_1")
SMOKE_CASES = ("smoke:1:64:1", "smoke:1:64:1:1:q4_1", "smoke:1:64:1:1:q4_1" + XLA)
PROMPT = "Write a Python function that checks whether a number is prime."
GB = 1e9


def check(smoke: bool) -> dict:
    """The GPU defaults decode a quantized model as the XLA path does (float32), and the
    dequantizing kernel multiplies as dequantize-then-matmul does."""
    shape = SHAPES["smoke" if smoke else "smol"]
    cfg = dataclasses.replace(shape, num_layers=min(4, shape.num_layers))
    model = quantized_twin(new_model(cfg, seed=1, dtype=jnp.float32), "q4_1")
    prompt = [[(7 * i) % cfg.vocab_size + 3 for i in range(40)]]
    plain = KernelConfig(quant_matmul="xla", fused_linear="off")
    default = generate(model, prompt, max_new_tokens=16).tokens
    out = {
        "tokens_equal_xla_path": default
        == generate(model, prompt, max_new_tokens=16, kernels=plain).tokens
    }
    mode = dict(interpret=jax.default_backend() != "gpu")
    rng = np.random.default_rng(0)
    for bits, group in ((8, None), (4, 128)):
        w = quant.quantize(jnp.asarray(rng.standard_normal((512, 384)), jnp.float32), bits, group)
        for m, suffix in ((8, ""), (1, "_one_row")):
            x = jnp.asarray(rng.standard_normal((m, 512)), jnp.float32)
            got = jnp.sum(quant_linear.qmatmul(x, w, **mode), axis=0)
            want = quant_linear.qmatmul_reference(x, w)
            err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            out[f"int{bits}{suffix}_max_rel_err"] = err
    if jax.default_backend() == "gpu":
        out.update(check_wgmma(rng))
    return out


def check_wgmma(rng) -> dict:
    """The Mosaic GPU kernel's products against dequantize-then-matmul in float32
    (``quant_wgmma.reference``, max relative error), for bf16 and float32 scales, at 1, 8 and 13
    rows."""
    out = {}
    for bits, group in ((8, None), (4, 128)):
        wf = jnp.asarray(rng.standard_normal((1024, 768)), jnp.bfloat16)
        for sdt in (jnp.bfloat16, jnp.float32):
            w = quant.quantize(wf, bits, group, scale_dtype=sdt)
            key = f"wgmma_int{bits}_{jnp.dtype(sdt).name}_scales"
            try:
                kw = quant_wgmma.prepare(w)
                for m in (1, 8, 13):
                    x = jnp.asarray(rng.standard_normal((m, 1024)), jnp.bfloat16)
                    got = quant_wgmma.qmatmul(x, kw)
                    want = quant_wgmma.reference(x, w)
                    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                    out[f"{key}_rows{m}_max_rel_err"] = err
            except Exception as e:  # recorded: the rest of the run still measures
                out[f"{key}_error"] = f"{type(e).__name__}: {e}"[:600]
            print(json.dumps({k: v for k, v in out.items() if k.startswith(key)}), flush=True)
    return out


def _product_us(product, x, ws) -> float:
    """Microseconds of one ``product(x, w)`` (``[M, N]``), back to back in one jitted loop over
    the distinct weights ``ws`` (``COPIES`` of them: one weight read again and again would be
    served from L2). The weights are arguments, not constants XLA could fold; a dequantize that
    XLA hoisted out of the loop would show as GB/s of packed bytes past the HBM's 4.8 TB/s."""

    def step(s, ws):
        for w in ws:
            y = product(s, w)
            s = s + (y[:, :1] * 0).astype(s.dtype)  # each call waits for the one before
        return s

    run = jax.jit(repeat(step), donate_argnums=0)
    return 1e3 * loop_ms(run, x, ws, n=8, reps=5) / len(ws)


def _kernel(tile):
    """``qmatmul`` with ``tile``, its partials summed."""
    bn, bk, splits, warps, stages = tile
    interpret = jax.default_backend() != "gpu"
    return lambda x, w: jnp.sum(quant_linear.qmatmul(
        x, w, interpret=interpret, bn=bn, bk=bk, splits=splits, num_warps=warps,
        num_stages=stages,
    ), axis=0)  # fmt: skip


def _xla(x, w):
    """The XLA path: dequantize to bf16, then XLA's GEMM (which may fuse the convert)."""
    wf = w if not quant.is_quantized(w) else quant.dequantize(w, jnp.bfloat16)
    return jnp.dot(x, wf, preferred_element_type=jnp.float32)


def _timed(product, x: dict, weights: dict) -> dict:
    """Microseconds and GB/s (of each weight's bytes as stored) on every sweep shape."""
    times = {name: _product_us(product, x[name], ws) for name, ws in weights.items()}
    nbytes = {name: _nbytes(ws[0]) for name, ws in weights.items()}
    return {
        "us": {k: round(v, 2) for k, v in times.items()},
        "gb_per_s": {k: round(nbytes[k] / GB / (times[k] * 1e-6), 1) for k in times},
    }


def _nbytes(w) -> int:
    return w.size * w.dtype.itemsize if isinstance(w, jax.Array) else w.nbytes


def _best(measured: list[dict], **match) -> list | None:
    """The tile of the least total time among the kernel rows matching ``match``."""
    ok = [r for r in measured if "us" in r and all(r.get(k) == v for k, v in match.items())]
    return min(ok, key=lambda r: sum(r["us"].values()))["tile"] if ok else None


def sweep(smoke: bool) -> dict:
    """Each tile's time on the sweep shapes, per bits and rows (8, as the model pads a step's
    stream on a GPU, and 1: the kernel pads every step to 16 rows), the XLA path's and the
    dense bf16 GEMM's at the same rows; the fastest tile per ``"bits:rows"``, and whether the
    XLA path beat it."""
    shapes = {"tiny": (256, 512)} if smoke else SWEEP_SHAPES
    copies = 1 if smoke else COPIES
    rng = np.random.default_rng(0)
    dense = {
        n: [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for _ in range(copies)]
        for n, s in shapes.items()
    }
    quantized = {
        bits: {
            name: [quant.quantize(w, bits, group, scale_dtype=jnp.float16) for w in ws]
            for name, ws in dense.items()
        }
        for bits, group in ((8, None), (4, 128))
    }
    rows, best, xla_faster = [], {}, {}
    for m in (8, 1):
        x = {name: jnp.ones((m, k), jnp.bfloat16) for name, (k, _) in shapes.items()}
        rows.append({"rows": m, "path": "bf16 dense, jnp.dot", **_timed(_xla, x, dense)})
        for bits, weights in quantized.items():
            xla = _timed(_xla, x, weights)
            rows.append({"rows": m, "bits": bits, "path": "xla: dequantize, jnp.dot", **xla})
            for tile in TILES:
                head = {"rows": m, "bits": bits, "path": "qmatmul", "tile": list(tile)}
                try:
                    rows.append({**head, **_timed(_kernel(tile), x, weights)})
                except Exception as e:  # a tile Triton cannot compile is a row, not the end
                    rows.append({**head, "error": f"{type(e).__name__}: {e}"[:300]})
                print(json.dumps(rows[-1]), flush=True)
            prepared = {}
            for tile in WGMMA_TILES[bits] if m == 8 and not smoke else ():
                head = {"rows": m, "bits": bits, "path": "wgmma", "tile": list(tile)}
                try:
                    group = 128 if bits == 4 else None
                    prepared = prepared or {
                        n: [
                            quant_wgmma.prepare(
                                quant.quantize(w, bits, group, scale_dtype=jnp.bfloat16)
                            )
                            for w in ws
                        ]
                        for n, ws in dense.items()
                    }
                    bk, stages, splits, tm = tile
                    product = functools.partial(
                        quant_wgmma.qmatmul, bk=bk, splits=splits, stages=stages, tm=tm
                    )
                    run = _timed(product, x, prepared)
                    rows.append({**head, **run})
                except Exception as e:
                    rows.append({**head, "error": f"{type(e).__name__}: {e}"[:600]})
                print(json.dumps(rows[-1]), flush=True)
            key = f"{bits}:{m}"
            tile = _best(rows, rows=m, bits=bits, path="qmatmul")
            if tile:
                best[key] = tile
            kern = [
                sum(r["us"].values()) for r in rows
                if r.get("rows") == m and r.get("bits") == bits and "tile" in r and "us" in r
            ]  # fmt: skip
            if kern:
                xla_faster[key] = sum(xla["us"].values()) < min(kern)
    return {"rows": rows, "best_tile": best, "xla_faster": xla_faster}


def steps(cases, tiles: dict, smoke: bool) -> list[dict]:
    """``run_case`` of each case; quantized ones with the sweep's tile for their bits."""
    out = []
    dtype = jnp.float32 if smoke else jnp.bfloat16
    base = KernelConfig.from_env()
    for text in cases:
        spec, xla = text.removesuffix(XLA), text.endswith(XLA)
        case = Case.parse(spec)
        name = case.name + (XLA if xla else "")
        kernels = base
        bits = {"int8": 8, "q8_0": 8}.get(case.quant, 4)
        tile = tiles.get(f"{bits}:8")
        if xla:
            kernels = dataclasses.replace(kernels, quant_matmul="xla")
        elif case.quant != "bf16" and tile:
            kernels = dataclasses.replace(kernels, quant_tile=tuple(tile))
        try:
            row = run_case(case, 8 if smoke else 32, 2 if smoke else 5, 4.3, dtype, kernels)
            layers = SHAPES[case.shape].num_layers
            row["kernels_per_layer"] = round((row["fusion_ops"] + row["custom_calls"]) / layers, 2)
            row["case"] = name
        except Exception as e:  # a failed case is recorded, the others still run
            row = {"case": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        out.append(row)
        print(
            json.dumps({k: row.get(k) for k in ("case", "ms_per_step", "floor_over_ms", "error")}),
            flush=True,
        )
    return out


def _tok_per_s(model, ids, new: int, repeats: int, **kw) -> dict:
    generate(model, [ids], max_new_tokens=new, **kw)  # compile
    runs = [generate(model, [ids], max_new_tokens=new, **kw) for _ in range(repeats)]
    rate = statistics.median(r.stats["tokens_per_s"] for r in runs)
    return {"tok_per_s": round(rate, 1), "tokens": runs[-1].tokens[0]}


def real(new: int, repeats: int) -> dict:
    """The real SmolLM2 Q4_1, kept quantized against dequantized at load."""
    gpu = jax.default_backend() == "gpu"
    with tempfile.TemporaryDirectory() as root:
        dtypes = ("bfloat16",) if gpu else ("float32", "bfloat16")
        out = {}
        for name in dtypes:
            ckpt = default_checkpoint(root, dtype=name, progress=False)
            kept, flat = load(ckpt, quantized=True), load(ckpt, quantized=False)
            ids = kept.tokenizer.apply_chat_template(
                [{"role": "user", "content": PROMPT}],
                add_generation_prompt=True, tokenize=True,
            )  # fmt: skip
            ids = [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
            for label, model in (("quantized", kept), ("dequantized", flat)):
                out[f"{name}_{label}"] = _tok_per_s(model, ids, new, repeats)
            q, d = out[f"{name}_quantized"], out[f"{name}_dequantized"]
            q["tokens_equal_dequantized"] = q.pop("tokens") == d.pop("tokens")
    return out


def headline(gpu: dict) -> dict:
    """The top-level ratios, from the GPU section (one run)."""
    rows = {r["case"]: r for r in gpu.get("steps", []) if "ms_per_step" in r}
    out = {}
    for q in ("int8", "int4"):
        a, b = rows.get(f"8b:1:4096:1:1:{q}"), rows.get("8b:1:4096:1:1")
        if a and b:
            out[f"{q}_over_bf16_8b"] = round(a["ms_per_step"] / b["ms_per_step"], 3)
            out[f"{q}_of_floor_8b"] = a["floor_over_ms"]
        a = rows.get(f"8b:1:4096:1:1:{q}{XLA}")
        if a and b:
            out[f"{q}_xla_over_bf16_8b"] = round(a["ms_per_step"] / b["ms_per_step"], 3)
    a, b = rows.get("smol:1:1024:1:1:q4_1"), rows.get("smol:1:1024:1:1")
    if a and b:
        out["smol_q4_1_over_bf16"] = round(a["ms_per_step"] / b["ms_per_step"], 3)
    r = gpu.get("real", {})
    if "bfloat16_quantized" in r:
        out["real_q4_1_over_bf16_tok_per_s"] = round(
            r["bfloat16_quantized"]["tok_per_s"] / r["bfloat16_dequantized"]["tok_per_s"], 3
        )
    return out


def table_rows(device: str, run: dict) -> list[dict]:
    """One row per measurement, its float baseline of the same run beside it."""
    out = []
    steps_by = {r["case"]: r for r in run.get("steps", []) if "ms_per_step" in r}
    for r in run.get("steps", []):
        if "ms_per_step" not in r:
            out.append({"device": device, "case": r["case"], "error": r.get("error")})
            continue
        plain = r["case"].removesuffix(XLA)
        base = steps_by.get(plain.rsplit(":", 1)[0] if r["quant"] != "bf16" else plain)
        out.append({
            "device": device, "case": r["case"],
            "weights": r["quant"] + (" (xla path)" if r["case"].endswith(XLA) else ""),
            "ms_per_step": r["ms_per_step"], "bf16_ms_per_step": base and base["ms_per_step"],
            "over_bf16": base and round(r["ms_per_step"] / base["ms_per_step"], 3),
            "floor_ms": r["floor_ms"], "of_floor": r["floor_over_ms"],
            "kernels_per_layer": r["kernels_per_layer"],
        })  # fmt: skip
    real_runs = run.get("real", {})
    for key, r in real_runs.items():
        dtype, kept = key.split("_")
        base = real_runs.get(f"{dtype}_dequantized", {})
        out.append({
            "device": device, "case": f"real SmolLM2-135M Q4_1, autoregressive, {dtype}",
            "weights": "Q4_1 kept" if kept == "quantized" else "dequantized at load",
            "tok_per_s": r["tok_per_s"], "float_tok_per_s": base.get("tok_per_s"),
            "over_float": round(r["tok_per_s"] / base["tok_per_s"], 3) if base else None,
        })  # fmt: skip
    return out


def save(out: pathlib.Path, device: str, run: dict, asked: list[str]) -> dict:
    """Write this run as the ``device`` section of ``out``, keeping the other device's section
    (the GPU runner starts from the committed file), with the headline ratios and the rows of
    both on top. A section of this device that the run was not asked for (``--sections``: the
    GPU runner leaves ``real`` out where it has no GGUF) stays from the file, with the date and
    commit of the run that measured it under ``carried``."""
    old = json.loads(out.read_text()) if out.is_file() else {}
    sections = {k: old[k] for k in ("cpu", "gpu") if k in old}
    before = sections.get(device, {})
    run = dict(run)
    for name in SECTIONS:
        if name not in asked and name in before:
            run[name] = before[name]
            was = before.get("carried", {}).get(name) or {
                k: before.get(k) for k in ("date", "commit", "device")
            }
            run.setdefault("carried", {})[name] = was
    sections[device] = run
    meta = {k: run[k] for k in ("date", "device", "jax", "commit", "command") if k in run}
    rows = [row for d in ("gpu", "cpu") if d in sections for row in table_rows(d, sections[d])]
    payload = {**meta, **headline(sections.get("gpu", {})), "rows": rows, **sections}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return payload


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--new", type=int, default=128, help="real: new tokens a call")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in float32 (CPU check)")
    ap.add_argument("--out", default="benchmarks/results/quantized.json")
    args = ap.parse_args()
    start, out = time.perf_counter(), pathlib.Path(args.out)
    device = "gpu" if jax.default_backend() == "gpu" else "cpu"
    run = {**metadata(), "command": "python " + " ".join(sys.argv)}
    tiles, payload = {}, {}
    asked = [s for s in args.sections.split(",") if s]
    if unknown := sorted(set(asked) - set(SECTIONS)):
        ap.error(f"unknown sections {unknown}: choose from {','.join(SECTIONS)}")
    for section in asked:
        if time.perf_counter() - start > args.budget_s:
            run.setdefault("skipped", []).append(section)
            continue
        t0 = time.perf_counter()
        if section == "check":
            run["check"] = check(args.smoke)
        elif section == "sweep":
            run["sweep"] = sweep(args.smoke)
            tiles = run["sweep"]["best_tile"]
        elif section == "steps":
            cases = SMOKE_CASES if args.smoke else STEP_CASES + SMOL_CASES
            run["steps"] = steps(cases, tiles, args.smoke)
        elif section == "real":
            run["real"] = real(args.new, args.repeats)
        run.setdefault("section_s", {})[section] = round(time.perf_counter() - t0, 1)
        payload = save(out, device, run, asked)
        print(f"{section}: {run['section_s'][section]} s", flush=True)
    shown = {k: v for k, v in payload.items() if k not in ("cpu", "gpu", "rows")}
    print(json.dumps(shown, indent=2))


if __name__ == "__main__":
    main()
