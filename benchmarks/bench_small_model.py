"""Small-model latency (issue 10): the real SmolLM2-135M-Instruct at batch 1.

Writes ``small_model.json`` with, at contexts 1024 and 4096 (a prompt of real text, HumanEval
prompts (OpenAI, MIT licence) concatenated, so the cache holds about that many tokens by the end):

* ``ar_tok_per_s_b1_ctx*``: jaxspec autoregressive (the whole loop on device), greedy; every
  ``*_tok_per_s*`` counts the whole call, the prompt's prefill included;
* ``first_token_ms_ctx*`` (a one-token call) and ``*_decode_tok_per_s_b1_ctx*`` (the tokens
  a call makes beyond a half-length call over the time it takes beyond it), with
  ``*_decode_over_ar_ctx*``: the decoding rates without the prefill that every method shares;
* ``chain_tok_per_s_b1_ctx*`` / ``tree_tok_per_s_b1_ctx*``: with each draft given (the distilled
  draft when ``--draft PATH`` names one, and ``ngram``); the best is also reported. With
  ``--gammas``, chain runs at each gamma too (``chain_<draft>_ctx*_gamma<g>_*``) and each draft's
  figure is its best gamma's (``chain_<draft>_ctx*_gamma``);
* ``hf_eager_tok_per_s_b1``: HF transformers' eager ``generate`` on the same weights and GPU,
  measured in the same run (short chat prompt, as ``bench_autoregressive.py``);
* ``fast_path_check``: greedy tokens of the fast path (the Pallas attention kernel) against the
  plain path (the jnp reference attention) on the same prompt, and of chain/tree against
  autoregressive; at a difference the target's top-2 logit gap there (bf16 near-tie rule);
* ``fast_path_check_f32``: the losslessness rule itself on the GPU, at the first context: the
  model in float32 with IEEE float32 dots (matmul precision "highest"; XLA's GPU default is
  TF32), chain and tree with each draft against autoregressive decoding, tokens equal;
* ``step_1b``: a Llama-3.2-1B-shape decode step (random weights) against its HBM floor.

    python benchmarks/bench_small_model.py [--draft DIR] [--new 128] [--gammas 6,8]
        [--out small_model.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.common import humaneval_prompts, metadata, write
from jaxspec.api import generate
from jaxspec.io.convert import load
from jaxspec.io.default_model import default_checkpoint, default_gguf_path


def context_ids(model, ctx: int, new: int) -> list[int]:
    ids = model.tokenizer.encode("\n".join(humaneval_prompts(20)))
    while len(ids) < ctx:
        ids = ids + ids
    return ids[: ctx - new]


def timed(model, ids, new, repeats, **kw):
    """(median tokens/s, last result); the first call compiles. Tokens/s counts the whole call:
    the prompt's prefill (time to the first token) and the decoding."""
    generate(model, [ids], max_new_tokens=new, **kw)
    runs = [generate(model, [ids], max_new_tokens=new, **kw) for _ in range(repeats)]
    tps = statistics.median(r.stats["tokens_per_s"] for r in runs)
    return tps, runs[-1]


def decode_rate(tps: float, new: int, half_tps: float) -> float:
    """Tokens/s of decoding alone: the tokens a ``new``-token call makes beyond a ``new // 2``
    call over the time it takes beyond it (the prefill and fixed costs are the same program's,
    so they cancel)."""
    half = new // 2
    return (new - half) / max(new / tps - half / half_tps, 1e-9)


def decode_only(tps, halves: dict, label: str, model, ids, new, repeats, **kw) -> float:
    """``decode_rate`` of a call that made ``tps``, timing its half-length call once per
    ``label`` (kept in ``halves``)."""
    if label not in halves:
        halves[label] = timed(model, ids, new // 2, repeats, **kw)[0]
    return decode_rate(tps, new, halves[label])


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(model, prompt: list[int], out: list[int], at: int) -> float:
    """The target's top-2 logit gap where the greedy outputs first differ."""
    logits = model.logits([prompt + out[:at]])[0, -1]
    top = jnp.sort(logits)[-2:]
    return float(top[1] - top[0])


def compare(model, prompt, ref: list[int], got: list[int]) -> dict:
    at = first_difference(ref, got)
    row = {"identical": at is None, "tokens": len(ref)}
    if at is not None:
        row.update(first_difference=at, top2_logit_gap=round(top2_gap(model, prompt, ref, at), 4))
    return row


def float32_check(ids: list[int], new: int, draft_path: str | None, trees=({"depth": 4},)) -> dict:
    """Chain and tree against autoregressive decoding with the model in float32 and float32
    dots: greedy tokens must be equal (a difference is a bug, not a near-tie)."""
    m32 = load(default_checkpoint(), dtype=jnp.float32)
    drafts = {"ngram": "ngram"}
    if draft_path:
        from jaxspec.train.distill import load_draft

        drafts = {"distilled": load_draft(draft_path, m32), **drafts}
    rows = {}
    with jax.default_matmul_precision("highest"):
        ref = generate(m32, [ids], max_new_tokens=new).tokens[0]
        runs = [("chain", {"gamma": 8})] + [("tree", t) for t in trees]
        for method, opts in runs:
            for name, draft in drafts.items():
                r = generate(m32, [ids], max_new_tokens=new, method=method, draft=draft, **opts)
                tag = (
                    ""
                    if len(trees) == 1 or method == "chain"
                    else "_" + "x".join(str(v) for v in opts.values())
                )
                rows[f"{method}_{name}{tag}_vs_autoregressive"] = compare(
                    m32, ids, ref, r.tokens[0]
                )
    print("float32:", {k: v["identical"] for k, v in rows.items()}, flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--draft", default=None, help="a distilled draft folder (jaxspec distill)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument(
        "--gammas",
        default=None,
        help="chain gammas to run besides --gamma (e.g. 6,8); each draft's chain figure is then "
        "its best gamma's (bench_gamma_sweep.py: acceptance grows with gamma)",
    )
    ap.add_argument(
        "--tree-shapes",
        default="4x8x4",
        help="tree shapes to run, DEPTHxWIDTHxBRANCH, comma-separated (8 nodes verified each); "
        "each draft's tree figure is its best shape's (prompt lookup's tree is one looked-up "
        "path: at depth 8 it accepts what its gamma-8 chain does, 2.40 tokens a verification "
        "against 2.12 at depth 4)",
    )
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--skip-1b", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    model = load(default_checkpoint(), dtype=dtype)
    drafts = {"ngram": "ngram"}
    if args.draft:
        from jaxspec.train.distill import load_draft

        drafts = {"distilled": load_draft(args.draft, model), **drafts}
    payload = {
        **metadata(),
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
        "dtype": str(jnp.dtype(dtype)),
        "new_tokens": args.new,
        "gamma": args.gamma,
        "gammas": args.gammas,
        "tree_shape": {"depth": 4, "width": 8, "branch": 4, "bs": 8},
        "tree_shapes": args.tree_shapes,
        "drafts": list(drafts),
    }
    path = None
    checks = {}
    for ctx in [int(c) for c in args.contexts.split(",") if c]:
        ids = context_ids(model, ctx, args.new)
        ar_tps, ar = timed(model, ids, args.new, args.repeats)
        payload[f"ar_tok_per_s_b1_ctx{ctx}"] = round(ar_tps, 1)
        first_s = 1.0 / timed(model, ids, 1, args.repeats)[0]  # prefill + the first token
        payload[f"first_token_ms_ctx{ctx}"] = round(1e3 * first_s, 2)
        halves = {}  # each call again at half the tokens, for the decode-only rates
        ar_decode = decode_only(ar_tps, halves, "ar", model, ids, args.new, args.repeats)
        payload[f"ar_decode_tok_per_s_b1_ctx{ctx}"] = round(ar_decode, 1)
        print(
            f"ctx {ctx}: autoregressive {ar_tps:.1f} tok/s; first token {1e3 * first_s:.1f} ms; "
            f"decoding alone {ar_decode:.1f} tok/s",
            flush=True,
        )
        gammas = sorted({args.gamma, *(int(g) for g in (args.gammas or "").split(",") if g)})
        shapes = [dict(zip(("depth", "width", "branch"), map(int, x.split("x")), strict=True))
                  for x in args.tree_shapes.split(",") if x]  # fmt: skip
        runs = [("chain", {"gamma": g}) for g in gammas] + [("tree", sh) for sh in shapes]
        best: dict[str, float] = {}
        best_decode: dict[str, float] = {}
        for method, opts in runs:
            for name, draft in drafts.items():
                t0 = time.perf_counter()
                tps, r = timed(
                    model, ids, args.new, args.repeats, method=method, draft=draft, **opts
                )
                key = f"{method}_{name}_ctx{ctx}"
                several = len(gammas) > 1 if method == "chain" else len(shapes) > 1
                if several:  # each setting's own figures, besides the draft's best
                    tag = "x".join(str(v) for v in opts.values())
                    tag = f"gamma{tag}" if method == "chain" else f"shape{tag}"
                    payload[f"{key}_{tag}_tok_per_s"] = round(tps, 1)
                    payload[f"{key}_{tag}_acceptance_length"] = round(
                        r.stats["acceptance_length"], 3
                    )
                    checks[f"{key}_{tag}_vs_autoregressive"] = compare(
                        model, ids, ar.tokens[0], r.tokens[0]
                    )
                if tps > payload.get(f"{key}_tok_per_s", 0.0):  # the draft's best setting
                    payload[f"{key}_tok_per_s"] = round(tps, 1)
                    payload[f"{key}_acceptance_length"] = round(r.stats["acceptance_length"], 3)
                    if method == "chain":
                        payload[f"{key}_gamma"] = opts["gamma"]
                    else:
                        payload[f"{key}_shape"] = "x".join(str(v) for v in opts.values())
                    checks[f"{key}_vs_autoregressive"] = compare(
                        model, ids, ar.tokens[0], r.tokens[0]
                    )
                best[method] = max(best.get(method, 0.0), tps)
                label = f"{method}_{name}_{opts}"
                dec = decode_only(
                    tps, halves, label, model, ids, args.new, args.repeats,
                    method=method, draft=draft, **opts,
                )  # fmt: skip
                best_decode[method] = max(best_decode.get(method, 0.0), dec)
                acc = r.stats["acceptance_length"]
                took = time.perf_counter() - t0
                print(
                    f"  {method:>6} + {name:<10} {tps:8.1f} tok/s  acc {acc:.2f}  {opts}  "
                    f"({took:.0f} s)",
                    flush=True,
                )
        for method, tps in best.items():
            payload[f"{method}_tok_per_s_b1_ctx{ctx}"] = round(tps, 1)
            payload[f"{method}_over_ar_ctx{ctx}"] = round(tps / ar_tps, 2)
            rate = best_decode[method]
            payload[f"{method}_decode_tok_per_s_b1_ctx{ctx}"] = round(rate, 1)
            payload[f"{method}_decode_over_ar_ctx{ctx}"] = round(rate / ar_decode, 2)
        if ctx == int(args.contexts.split(",")[0]):
            # JAXSPEC_ATTENTION=reference: the jnp attention where the model dispatches (the
            # prefill's chunks); the fused decode-step kernel has its own switch
            import jaxspec.model.transformer as jm
            from jaxspec.engines import base as common

            before, jm.ATTENTION_IMPL = jm.ATTENTION_IMPL, "reference"
            common._COMPILED.clear()
            jax.clear_caches()
            plain_tps, plain = timed(model, ids, args.new, 1)
            jm.ATTENTION_IMPL = before
            common._COMPILED.clear()
            jax.clear_caches()
            payload[f"ar_plain_attention_tok_per_s_ctx{ctx}"] = round(plain_tps, 1)
            checks["pallas_vs_reference_attention"] = compare(
                model, ids, plain.tokens[0], ar.tokens[0]
            )
        path = write("small_model.json", {**payload, "fast_path_check": checks}, args.out)
    first = int(args.contexts.split(",")[0])
    checks_f32 = float32_check(
        context_ids(model, first, args.new), args.new, args.draft, trees=shapes
    )
    payload["fast_path_check_f32"] = checks_f32
    payload["ar_tok_per_s_b1"] = payload[f"ar_tok_per_s_b1_ctx{first}"]
    payload["chain_tok_per_s_b1"] = payload[f"chain_tok_per_s_b1_ctx{first}"]
    payload["tree_tok_per_s_b1"] = payload[f"tree_tok_per_s_b1_ctx{first}"]
    if not args.no_hf:
        import torch

        from benchmarks.bench_autoregressive import PROMPT, bench_hf
        from jaxspec.prompts import encode_text

        hf_ids = encode_text(model.tokenizer, PROMPT, chat=True)
        hf_tps, _ = bench_hf(
            default_gguf_path(),
            hf_ids,
            args.new,
            args.repeats,
            torch.bfloat16 if gpu else torch.float32,
        )
        payload["hf_eager_tok_per_s_b1"] = round(hf_tps, 1)
        short_tps, _ = timed(model, hf_ids, args.new, args.repeats)
        payload["ar_tok_per_s_b1_short_prompt"] = round(short_tps, 1)
        print(f"HF eager {hf_tps:.1f} tok/s; jaxspec on the same prompt {short_tps:.1f}")
    if not args.skip_1b:
        from benchmarks.bench_decode_gpu import Case, run_case

        payload["step_1b"] = run_case(
            Case("1b" if gpu else "smoke", 1, 4096 if gpu else 64, 1), 32, 5, 4.3, dtype
        )
    path = write("small_model.json", {**payload, "fast_path_check": checks}, args.out)
    return path


if __name__ == "__main__":
    main()
