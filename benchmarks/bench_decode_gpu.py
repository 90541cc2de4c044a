"""Decode and verify step times of model shapes against their HBM floor (random bf16 weights).

One case = (shape, batch, context, block size T, tensor-parallel degree and form, weights:
``bf16`` or a quantized twin, see ``QUANT``). A case times
the project's own forward (``jaxspec.model.transformer.apply``: unrolled layers, the Pallas
decode-attention kernel on GPU, in-place cache writes) inside one jitted ``lax.fori_loop`` of
``--steps`` steps with the cache donated, so the figure is the per-step cost with the loop on
device, as the engines run it. The floor is the bytes a step must read (every weight except an
untied input embedding, of which one row is read, plus the visible K/V) over ``--hbm-tbs`` (4.3 TB/s
for an H200); a quantized weight counts its bytes as stored (codes, scales, mins).

A tensor-parallel case names its form: ``gspmd`` (the one-device forward on sharded weights),
``shard_map`` (the explicit step of ``jaxspec/model/tensor_parallel.py`` with XLA's all-reduce),
``oneshot`` (the same step with the Mosaic GPU one-shot all-reduce of
``pallas_kernels/all_reduce.py``), ``oneshot_reference`` (the one-shot algorithm as collective
permutes); none: ``KernelConfig.from_env()``'s. The output's top level gets the headline figures
of the 8B batch-1 4K decode rows (``headline``): ``ms_per_token_tp2`` / ``_tp4`` from the explicit
step (its faster reduction), beside the one-GPU step of the same run.

XLA flags are read when jax starts, so flag variants are separate processes: see
``benchmarks/gpu/decode.sh`` and ``benchmarks/gpu/tp.sh``. ``--label`` tags the rows of one
process; rows are appended to the JSON (``--out``) as each case finishes, so a timeout keeps
what was measured.

    python benchmarks/bench_decode_gpu.py --cases 8b:1:4096:1,8b:1:4096:16 --out decode.json
    python benchmarks/bench_decode_gpu.py --cases 8b:1:4096:1:1:int4 --out decode.json
    python benchmarks/bench_decode_gpu.py --cases 8b:1:4096:1,8b:1:4096:1:2:shard_map  # 2 GPUs
    python benchmarks/bench_decode_gpu.py --smoke      # tiny shapes, CPU check of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.common import metadata  # noqa: E402
from benchmarks.shapes import LLAMA3_8B, LLAMA32_1B, SMOKE, SMOLLM2_135M  # noqa: E402
from jaxspec.config import ModelConfig  # noqa: E402
from jaxspec.kernels import KernelConfig  # noqa: E402
from jaxspec.model import quantized as Q  # noqa: E402
from jaxspec.model import sharding, tensor_parallel  # noqa: E402
from jaxspec.model.kv_cache import KVCache, causal_block, init_cache  # noqa: E402
from jaxspec.model.transformer import apply, new_model, with_params  # noqa: E402
from jaxspec.timing import median_ms  # noqa: E402
from pallas_kernels import quant  # noqa: E402

DUMP_HLO = os.environ.get("JAXSPEC_DUMP_HLO", "")  # a folder: write each case's optimized HLO
SHAPES = {"8b": LLAMA3_8B, "1b": LLAMA32_1B, "smol": SMOLLM2_135M, "smoke": SMOKE}
# a case's tensor-parallel form -> the KernelConfig fields it sets
FORMS = {
    "gspmd": dict(tensor_parallel="gspmd"),
    "shard_map": dict(tensor_parallel="shard_map", all_reduce="psum"),
    "oneshot": dict(tensor_parallel="shard_map", all_reduce="oneshot"),
    "oneshot_reference": dict(tensor_parallel="shard_map", all_reduce="oneshot_reference"),
}


# Quantized twins of the random weights (jaxspec.model.quantized): (bits, group, mins, scale
# dtype, the tied embedding's (bits, group)). q4_1 / q8_0 are GGUF's layouts as the shipped
# SmolLM2 GGUF has them (Q4_1 layers, a Q8_0 embedding); int8 / int4 are `convert --quantize`'s.
QUANT = {
    "int8": (8, None, False, jnp.bfloat16, None),
    "int4": (4, 128, False, jnp.bfloat16, None),
    "q8_0": (8, 32, False, jnp.float16, None),
    "q4_1": (4, 32, True, jnp.float16, (8, 32)),
}


@dataclasses.dataclass(frozen=True)
class Case:
    shape: str
    batch: int
    context: int
    t: int  # tokens per step: 1 = decode, k = a k-token verify block
    tp: int = 1
    quant: str = "bf16"  # or a key of QUANT
    form: str = ""  # FORMS key; "": the kernels' own

    @classmethod
    def parse(cls, text: str) -> Case:
        parts = text.split(":")
        shape, b, s, t = parts[:4]
        tp = int(parts[4]) if len(parts) > 4 else 1
        q, form = "bf16", ""
        for extra in parts[5:]:  # a form and / or the weights, in either order
            if extra in FORMS:
                form = extra
            elif extra == "bf16" or extra in QUANT:
                q = extra
            else:
                raise SystemExit(
                    f"case {text!r}: {extra!r} is neither a form ({', '.join(FORMS)}) nor "
                    f"weights (bf16, {', '.join(QUANT)})"
                )
        return cls(shape, int(b), int(s), int(t), tp, q, form)

    @property
    def name(self) -> str:
        name = f"{self.shape}:{self.batch}:{self.context}:{self.t}:{self.tp}"
        name = f"{name}:{self.form}" if self.form else name
        return name if self.quant == "bf16" else f"{name}:{self.quant}"


def quantized_twin(model, kind: str):
    """``model`` with its projections and LM head quantized as ``QUANT[kind]`` says."""
    bits, group, mins, scale_dtype, embed = QUANT[kind]
    cfg = model.config

    def one(path, w):
        if not Q.quantizable(path, cfg):
            return w
        b, g = embed if (embed and path == Q.EMBEDDING) else (bits, group)
        w = w.T if path == Q.EMBEDDING else w
        qw = quant.quantize(w, b, g, scale_dtype=scale_dtype)
        if mins and b == 4:  # the asymmetric layout: w = q * s + m with m = -8 s
            low = (-quant.OFFSET4 * qw.scales.astype(jnp.float32)).astype(scale_dtype)
            qw = quant.QuantizedWeight(qw.values, qw.scales, low, 4, qw.group, qw.dtype)
        return qw

    pure = jax.tree_util.tree_map_with_path(
        lambda p, w: one(tuple(getattr(k, "key", k) for k in p), w),
        nnx.to_pure_dict(model.params),
    )
    state = jax.tree.map(lambda x: x, model.params)
    nnx.replace_by_pure_dict(state, pure)
    return Q.for_wgmma(with_params(model, state, name=f"{model.name}-{kind}"))


def _nbytes(x) -> int:
    """Bytes of an array as stored (int4: two codes a byte, where ``itemsize`` says 1)."""
    bits = 4 if jnp.dtype(x.dtype) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)) else 8
    return x.size * jnp.dtype(x.dtype).itemsize * bits // 8


def param_bytes(cfg: ModelConfig, params) -> int:
    total = sum(_nbytes(x) for x in jax.tree.leaves(params))
    if not cfg.tie_word_embeddings:  # the input embedding: one row per token is read
        total -= cfg.vocab_size * cfg.hidden_size * jax.tree.leaves(params)[0].dtype.itemsize
    return total


def kv_bytes(cfg: ModelConfig, batch: int, context: int, itemsize: int) -> int:
    return 2 * cfg.num_layers * batch * context * cfg.num_kv_heads * cfg.head_dim * itemsize


def make_loop(net, steps: int, t: int):
    """A jitted loop of ``steps`` forwards of ``t`` tokens per row of the model ``net`` describes
    (on its flat weights); each step's argmax feeds the next (so steps cannot overlap) and the
    cache is donated (written in place)."""

    def run(params, cache, tok):
        def body(_, carry):
            cache, tok = carry
            b = tok.shape[0]
            block = causal_block(cache.length, cache.length, jnp.full((b,), t, jnp.int32), t)
            logits, cache = apply(net, params, tok, cache, block)
            cache = KVCache(k=cache.k, v=cache.v, length=cache.length + t)
            # over the split vocabulary under the explicit step: (max, index) pairs, no logits
            return cache, tensor_parallel.argmax(net, logits)

        return jax.lax.fori_loop(0, steps, body, (cache, tok))

    return jax.jit(run, donate_argnums=1)


def kernel_count(exe_text: str) -> dict:
    """Rough launch census of one compiled program: fusions by kind (Triton GEMM fusions apart),
    custom calls by target (cuBLAS, Pallas/Triton kernels), collectives."""
    import re

    counts: dict = {}
    for ln in exe_text.splitlines():
        if " fusion(" in ln:
            m = re.search(r"kind=(k\w+)", ln)
            kind = m.group(1) if m else "k?"
            if "__triton_gemm" in ln or "triton_gemm" in ln:
                kind = "triton_gemm"
            elif "__cublas" in ln:
                kind = "cublas_fusion"
            counts[f"fusion_{kind}"] = counts.get(f"fusion_{kind}", 0) + 1
        elif "custom-call(" in ln:
            m = re.search(r'custom_call_target="([^"]+)"', ln)
            key = "cc_" + (m.group(1) if m else "?")
            counts[key] = counts.get(key, 0) + 1
        for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
            if f" {op}(" in ln or f" {op}-start(" in ln:
                counts[op] = counts.get(op, 0) + 1
    counts["fusion_ops"] = sum(v for k, v in counts.items() if k.startswith("fusion_"))
    counts["custom_calls"] = sum(v for k, v in counts.items() if k.startswith("cc_"))
    return counts


def run_case(case: Case, steps: int, reps: int, hbm_tbs: float, dtype, kernels) -> dict:
    cfg = SHAPES[case.shape]
    kernels = dataclasses.replace(kernels, **FORMS.get(case.form, {}))
    devices = jax.devices()[: case.tp]
    model = new_model(cfg, seed=0, dtype=dtype)
    if case.quant != "bf16":
        model = quantized_twin(model, case.quant)
    cap = case.context + steps * case.t + 8
    cache = init_cache(cfg, case.batch, cap, dtype)
    cache = KVCache(k=cache.k, v=cache.v, length=jnp.full((case.batch,), case.context, jnp.int32))
    if case.tp > 1:  # sharded weights: the Net resolves without the fused kernels, as engines do
        model, rep = sharding.place(model, devices)
        kv = jax.NamedSharding(rep.mesh, tensor_parallel.KV_SPEC)
        cache = KVCache(
            k=[jax.device_put(x, kv) for x in cache.k],
            v=[jax.device_put(x, kv) for x in cache.v],
            length=jax.device_put(cache.length, rep),
        )
    net, params = model.net(kernels), model.flat
    tok = jnp.zeros((case.batch, case.t), jnp.int32)
    loop = make_loop(net, steps, case.t)
    t0 = time.perf_counter()
    exe = loop.lower(params, cache, tok).compile()
    compile_s = time.perf_counter() - t0
    text = exe.as_text()
    counts = kernel_count(text)
    if DUMP_HLO:
        pathlib.Path(DUMP_HLO).mkdir(parents=True, exist_ok=True)
        name = case.name.replace(":", "_") + "_" + os.environ.get("JAXSPEC_LABEL", "default")
        (pathlib.Path(DUMP_HLO) / f"{name}.hlo.txt").write_text(text)
    state = {"cache": cache}

    def once():
        c, out = exe(params, state["cache"], tok)
        # The loop advanced the lengths: rewind so every repetition reads the same context.
        state["cache"] = KVCache(k=c.k, v=c.v, length=c.length - steps * case.t)
        return out

    ms = median_ms(once, reps) / steps
    itemsize = jnp.dtype(dtype).itemsize
    wbytes = param_bytes(cfg, params)
    kbytes = kv_bytes(cfg, case.batch, case.context, itemsize)
    floor = (wbytes + kbytes) / (hbm_tbs * 1e12) * 1e3
    return {
        "case": case.name,
        **dataclasses.asdict(case),
        "ms_per_step": round(ms, 4),
        "floor_ms": round(floor, 4),
        "floor_over_ms": round(floor / ms, 3),
        "weight_gb": round(wbytes / 1e9, 3),
        "kv_gb": round(kbytes / 1e9, 3),
        "compile_s": round(compile_s, 1),
        "kernels": net.kernels.describe(),
        **counts,
    }


def headline(rows: list[dict], shape: str = "8b") -> dict:
    """The tensor-parallel figures of the ``shape`` batch-1 4K decode rows: the one-GPU step,
    each degree's step by form (``ms_per_token_tp2_shard_map``, ``..._oneshot``, ``..._gspmd``),
    ``ms_per_token_tp2`` = the explicit step's faster form, and its ratio to one GPU
    (``tp2_over_one_gpu``; issue 26's goals: at most 0.62 for 2, 0.40 for 4)."""
    best: dict[tuple[int, str], float] = {}
    for r in rows:
        if "ms_per_step" not in r or (r["shape"], r["batch"], r["context"], r["t"]) != (
            shape, 1, 4096, 1,
        ):  # fmt: skip
            continue
        key = (r["tp"], r.get("form") or "")
        best[key] = min(best.get(key, float("inf")), r["ms_per_step"])
    out: dict = {}
    one = min((v for (tp, _), v in best.items() if tp == 1), default=None)
    if one is not None:
        out["ms_per_token"] = one
    for (tp, form), ms in sorted(best.items()):
        if tp > 1 and form:
            out[f"ms_per_token_tp{tp}_{form}"] = ms
    for tp in sorted({tp for tp, _ in best if tp > 1}):
        mine = [v for (d, f), v in best.items() if d == tp and f in ("shard_map", "oneshot")]
        if mine:
            out[f"ms_per_token_tp{tp}"] = min(mine)
            if one is not None:
                out[f"tp{tp}_over_one_gpu"] = round(min(mine) / one, 3)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--cases",
        default="smol:1:1024:1,smol:1:4096:1,1b:1:4096:1,8b:1:4096:1,8b:1:4096:8,8b:1:4096:16,"
        "8b:64:4096:1",
        help="shape:batch:context:T[:tp[:form]], comma separated (shapes: "
        + ", ".join(SHAPES)
        + "; forms: "
        + ", ".join(FORMS)
        + ")",
    )
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hbm-tbs", type=float, default=4.3)
    ap.add_argument("--label", default=os.environ.get("JAXSPEC_LABEL", "default"))
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in float32 (CPU check)")
    ap.add_argument("--out", default="benchmarks/results/decode_rows.json")
    args = ap.parse_args()
    start = time.perf_counter()
    cases = (
        [
            Case("smoke", 1, 64, 1),
            Case("smoke", 2, 64, 4),
            Case("smoke", 1, 64, 1, quant="q4_1"),
            Case("smoke", 1, 64, 1, 2, form="shard_map"),
        ]
        if args.smoke
        else [Case.parse(c) for c in args.cases.split(",") if c]
    )
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    kernels = KernelConfig.from_env()
    out = pathlib.Path(args.out)
    payload = json.loads(out.read_text()) if out.is_file() else {**metadata(), "rows": []}
    for case in cases:
        if time.perf_counter() - start > args.budget_s:
            print(f"budget spent: skipping {case.name}", flush=True)
            continue
        try:
            row = run_case(case, args.steps, args.reps, args.hbm_tbs, dtype, kernels)
        except Exception as e:  # a failed case is recorded, the others still run
            row = {"case": case.name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        row["label"] = args.label
        row["xla_flags"] = os.environ.get("XLA_FLAGS", "")
        payload["rows"].append(row)
        payload.update(headline(payload["rows"]))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2) + "\n")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
