"""Small-model latency: the real SmolLM2-135M-Instruct at batch 1, as a user calls ``generate``.

    python benchmarks/bench_small_model.py [--draft DIR] [--feature DIR] [--new 128]
        [--contexts 1024,4096]
        [--peer PATH/torch_cudagraph.py] [--out small_model.json]

Per context (a prompt of real text: HumanEval prompts (OpenAI, MIT licence) concatenated, cut so
the cache holds the context by the end), each method and draft is called ``--repeats`` times
after a warm-up call (the compile), and two rates are kept, medians over the calls:

- ``*_wall_tok_per_s``: new tokens over the wall clock of the whole ``generate()`` call, timed
  around it as a user would (prefill, host work and the final copy included);
- ``*_engine_tok_per_s``: new tokens over the engine's own ``stats.wall_s`` (dispatch to result).

Drafts: prompt lookup (``ngram``), ``--draft`` (the distilled small model: rows ``*_draft``) and
``--feature`` (a feature head: ``chain_feature``, ``tree_feature``, and
``tree_over_chain_feature``).

Top-level keys (1K context, B=1, ``--new`` tokens): ``ar_wall_tok_per_s_b1``,
``best_spec_wall_tok_per_s_b1`` (the best speculative method and draft), ``peer_tok_per_s_b1`` (the
PyTorch CUDA-graph peer on the same weights and prompt, run in the same process's machine by
``--peer``: its whole-call tokens/s), ``tree_over_chain_same_draft`` (tree over chain wall tokens/s
with the shipped draft; ``--trees`` adds other shapes' rows and
``tree_shapes_over_chain_same_draft``, or ``..._same_feature`` for the feature head's),
``first_token_ms_ctx4096`` (the wall of a one-token call after the 4K prompt). Exactness:
``partings`` compares every run's tokens with autoregressive decoding (bf16: a parting must be a
near-tie, its top-2 logit gap reported) and ``float32_check`` runs the model in float32 with IEEE
dots, where every method must give exactly the autoregressive tokens. ``streaming`` (unless
``--no-stream``): the same 1K calls through ``jaxspec.stream``, every piece consumed, against
``generate``: ``overhead`` is generate's tokens/s over stream's, less one, and ``first_piece_ms``
the wait for the first piece. ``--random-weights`` measures only that
section, on random SmolLM2-135M-shape bf16 weights (no GGUF: one GPU call; what a segment boundary
costs does not depend on the weights), and ``--merge`` puts it into a full run's file with its own
commit and command (``streaming_run``). ``--draft-vocab`` sets the draft's head (``load_draft``'s
``vocab``, ``model.vocab_head``; ``draft_vocab`` in the file) and ``--compare-vocab`` adds the
draft's chain and tree with another head (rows ``chain_draft@full``, ...).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_host_overhead import SMOLLM2  # noqa: E402
from benchmarks.common import (  # noqa: E402
    add_vocab_args,
    context_ids,
    metadata,
    random_target,
    write,
)
from jaxspec.api import generate, stream  # noqa: E402
from jaxspec.io.convert import load  # noqa: E402
from jaxspec.io.default_model import default_checkpoint, default_gguf_path  # noqa: E402
from jaxspec.io.draft_checkpoint import load_draft  # noqa: E402
from jaxspec.kernels import KernelConfig  # noqa: E402
from jaxspec.model.vocab_head import vocab_size_of  # noqa: E402


def timed(model, ids, new, repeats, **kw) -> dict:
    """Median wall and engine tokens/s of ``repeats`` calls after a warm-up one."""
    generate(model, [ids], max_new_tokens=new, **kw)
    walls, engines, last = [], [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        last = generate(model, [ids], max_new_tokens=new, **kw)
        walls.append(time.perf_counter() - t0)
        engines.append(last.stats["wall_s"])
    n = last.stats["new_tokens"]
    return {
        "wall_tok_per_s": round(n / statistics.median(walls), 1),
        "engine_tok_per_s": round(n / statistics.median(engines), 1),
        "outside_ms": round(
            1e3 * statistics.median(w - e for w, e in zip(walls, engines, strict=True)), 3
        ),
        "acceptance_length": round(last.stats["acceptance_length"], 3),
        "tokens": last.tokens[0],
    }


def streamed(model, ids, new, repeats, **kw) -> dict:
    """``jaxspec.stream`` of the same call, every piece consumed: median wall tokens/s and the
    median time to the first piece (after a warm-up call)."""

    def once():
        t0 = time.perf_counter()
        first = None
        s = stream(model, [ids], max_new_tokens=new, **kw)
        for _ in s:
            first = first or time.perf_counter() - t0
        return time.perf_counter() - t0, first, s.result

    once()
    runs = [once() for _ in range(repeats)]
    n = runs[-1][2].stats["new_tokens"]
    return {
        "wall_tok_per_s": round(n / statistics.median(r[0] for r in runs), 1),
        "first_piece_ms": round(1e3 * statistics.median(r[1] for r in runs), 2),
        "tokens": runs[-1][2].tokens[0],
    }


def streaming(model, ids, args) -> dict:
    """Streaming overhead: ``stream`` against ``generate`` of the same call (autoregressive and
    chain + prompt lookup), at each ``--stream-steps`` segment length, the streamed tokens
    checked equal to the generated ones. Rows ``<run>@<steps>``."""
    out = {}
    for name, kw in (("autoregressive", {}), ("chain_ngram", {"method": "chain", "draft": "ngram",
                                                               "gamma": 8})):  # fmt: skip
        plain = timed(model, ids, args.new, args.repeats, **kw)
        for steps in [int(x) for x in args.stream_steps.split(",") if x]:
            r = streamed(model, ids, args.new, args.repeats, segment_steps=steps, **kw)
            row = out[f"{name}@{steps}"] = {
                "segment_steps": steps,
                "stream_wall_tok_per_s": r["wall_tok_per_s"],
                "generate_wall_tok_per_s": plain["wall_tok_per_s"],
                "overhead": round(plain["wall_tok_per_s"] / r["wall_tok_per_s"] - 1, 4),
                "first_piece_ms": r["first_piece_ms"],
                "same_tokens": r["tokens"] == plain["tokens"],
            }
            print(f"stream {name}@{steps}: {row}", flush=True)
    return out


def parting(model, prompt, ref: list[int], got: list[int]) -> dict:
    """Where ``got`` first differs from ``ref``, and the target's top-2 logit gap there."""
    at = next((i for i, (x, y) in enumerate(zip(ref, got, strict=False)) if x != y), None)
    if at is None and len(ref) != len(got):
        at = min(len(ref), len(got))
    if at is None:
        return {"identical": True}
    top = jnp.sort(model.logits([prompt + ref[:at]])[0, -1])[-2:]
    return {
        "identical": False,
        "first_difference": at,
        "top2_gap": round(float(top[1] - top[0]), 4),
    }


RUNS = (  # (name, method, draft key, options)
    ("chain_ngram", "chain", "ngram", {"gamma": 8}),
    ("chain_draft", "chain", "draft", {"gamma": 4}),
    ("tree_draft", "tree", "draft", {}),
    ("tree_ngram", "tree", "ngram", {"depth": 8, "width": 1, "branch": 1}),
    # --feature: the feature head's chain and its default tree (tree.FEATURE_SHAPE: the GPU's)
    ("chain_feature", "chain", "feature", {"gamma": 4}),
    ("tree_feature", "tree", "feature", {}),
)


def tree_runs(spec: str) -> tuple:
    """``--trees``' shapes (``DEPTHxWIDTHxBRANCHxBS``, comma-separated) as ``RUNS`` entries with
    the model draft, named ``tree_draft_<shape>``; ``feature:<shape>`` with the feature head,
    named ``tree_feature_<shape>``."""
    out = []
    for item in (s for s in spec.split(",") if s):
        key, _, shape = item.rpartition(":")
        key = key or "draft"
        if key not in ("draft", "feature"):
            raise SystemExit(f"--trees: {item!r}: the prefix is feature: or none")
        depth, width, branch, bs = (int(v) for v in shape.split("x"))
        opts = {"depth": depth, "width": width, "branch": branch, "bs": bs}
        out.append((f"tree_{key}_{shape}", "tree", key, opts))
    return tuple(out)


def vocab_of(key: str, args):
    """The ``vocab`` a ``drafts`` key was loaded with: ``--compare-vocab``'s for the ``@`` rows."""
    return args.compare_vocab if "@" in key else args.draft_vocab


def f32_drafts(drafts, args) -> dict:
    """The float32 check's drafts: each ``drafts`` key as (folder, vocab), ``"ngram"`` as is."""
    folders = {"draft": args.draft, "feature": args.feature}
    return {
        k: "ngram" if k == "ngram" else (folders[k.split("@")[0]], vocab_of(k, args))
        for k in drafts
    }


def vocab_runs(drafts) -> tuple:
    """``--compare-vocab``'s rows: the draft's chain and tree with the other head, named
    ``chain_draft@<vocab>`` and ``tree_draft@<vocab>``."""
    return tuple(
        (f"{name}@{key.split('@')[1]}", method, key, opts)
        for key in drafts
        if key.startswith("draft@")
        for name, method, k, opts in RUNS
        if k == "draft"
    )


def run_context(model, drafts, ctx, args) -> dict:
    ids = context_ids(model, ctx, args.new)
    rows = {"autoregressive": timed(model, ids, args.new, args.repeats)}
    ref = rows["autoregressive"]["tokens"]
    for name, method, key, opts in RUNS + tree_runs(args.trees) + vocab_runs(drafts):
        if key in drafts:
            r = timed(model, ids, args.new, args.repeats, method=method, draft=drafts[key], **opts)
            r["parting"] = parting(model, ids, ref, r.pop("tokens"))
            rows[name] = r
            print(f"ctx {ctx} {name}: {r['wall_tok_per_s']} tok/s (wall)", flush=True)
    rows["autoregressive"].pop("tokens")
    first = timed(model, ids, 1, args.repeats)
    return {
        "rows": rows,
        "first_token_ms": round(1e3 / first["wall_tok_per_s"], 2),
        "first_token_outside_ms": first["outside_ms"],  # of it, the host's time outside the engine
        "ids": ids,
    }


def float32_check(ids, new, drafts_f32) -> dict:
    """Every method against autoregressive decoding in float32 with IEEE float32 dots."""
    m32 = load(default_checkpoint(), dtype=jnp.float32)
    out = {}
    with jax.default_matmul_precision("highest"):
        ref = generate(m32, [ids], max_new_tokens=new).tokens[0]
        for name, method, key, opts in RUNS + vocab_runs(drafts_f32):
            if key in drafts_f32:
                path, vocab = drafts_f32[key] if key != "ngram" else (None, None)
                d = "ngram" if key == "ngram" else load_draft(path, m32, vocab=vocab)
                got = generate(m32, [ids], max_new_tokens=new, method=method, draft=d, **opts)
                out[name] = got.tokens[0] == ref
    print("float32 equal to autoregressive:", out, flush=True)
    return out


# The peer's rows this benchmark keeps: its own CUDA-graph decoder and HF's eager generate. Once
# both are in, the peer is stopped: its last row (HF's static cache under torch.compile) has
# failed on every image so far ("accessing tensor output of CUDAGraphs that has been
# overwritten") after minutes of compiling, which on an H100 (7deed54's call) took the rest of
# a call's 570 s and the 4K rows with it.
PEER_ROWS = ("torch_cudagraph_real", "hf_eager_real")


def peer(path: str, ids: list[int], new: int, timeout_s: float = 420) -> dict | None:
    """The PyTorch CUDA-graph peer's whole-call tokens/s on the same GGUF weights and prompt
    (``PEER_ROWS``' rows, read as the peer prints them; None if its own row never came)."""
    rows, err = [], ""
    with tempfile.TemporaryDirectory() as tmp:
        f = pathlib.Path(tmp) / "ids.json"
        # the key names the peer's rows: the context the cache holds by the end
        f.write_text(json.dumps({f"ctx{len(ids) + new}": ids}))
        log = pathlib.Path(tmp) / "stderr.txt"  # a file: a full pipe would stall the peer
        errf = log.open("w")
        proc = subprocess.Popen(
            ["python3", path, "real", str(default_gguf_path()), str(f)],
            stdout=subprocess.PIPE, stderr=errf, text=True,
        )  # fmt: skip
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                if line.startswith("{"):
                    rows.append(json.loads(line))
                labels = [r.get("label", "") for r in rows]
                if all(any(x.startswith(want) for x in labels) for want in PEER_ROWS):
                    break
        finally:
            timer.cancel()
            proc.kill()
            proc.wait()
            proc.stdout.close()
            errf.close()
            err = log.read_text(errors="replace")[-1500:]
    graph = [x for x in rows if x.get("label", "").startswith(PEER_ROWS[0])]
    if not graph or "tok_per_s_whole_call" not in graph[-1]:
        print("peer failed:", rows, err, flush=True)
        return None
    # the CUDA-graph row is the peer; HF's eager row rides along
    return {**graph[-1], "others": [x for x in rows if x is not graph[-1] and "label" in x]}


def summarise(payload: dict, ctx: int) -> None:
    """The headline figures, from context ``ctx``'s rows."""
    first = payload[f"ctx{ctx}"]["rows"]
    payload["ar_wall_tok_per_s_b1"] = first["autoregressive"]["wall_tok_per_s"]
    spec = {k: v["wall_tok_per_s"] for k, v in first.items() if k != "autoregressive"}
    payload["best_spec"] = max(spec, key=spec.get)
    payload["best_spec_wall_tok_per_s_b1"] = spec[payload["best_spec"]]
    for key, ratio in (("draft", "tree_over_chain_same_draft"),
                       ("feature", "tree_over_chain_feature")):  # fmt: skip
        if f"tree_{key}" not in first or f"chain_{key}" not in first:
            continue
        chain = first[f"chain_{key}"]["wall_tok_per_s"]
        payload[ratio] = round(first[f"tree_{key}"]["wall_tok_per_s"] / chain, 3)
        shapes = {
            k: round(v["wall_tok_per_s"] / chain, 3)
            for k, v in first.items()
            if k.startswith(f"tree_{key}_")
        }
        if shapes:  # --trees: each shape's tokens/s over the chain's, same draft
            payload[f"tree_shapes_over_chain_same_{key}"] = shapes


def merged(first: str, more: str) -> dict:
    """``first``'s payload with the contexts of ``more`` that it lacks, each with the commit and
    command that measured it."""
    a, b = (json.loads(pathlib.Path(p).read_text()) for p in (first, more))
    for key in sorted(k for k in b if k.startswith("ctx") and k not in a):
        a[key] = {"commit": b["commit"], "command": b["command"], **b[key]}  # its own, if kept
    if "streaming" in b and "ctx1024" not in b:  # a --random-weights run: its section replaces
        a["streaming"] = b["streaming"]
        a["streaming_run"] = {k: b[k] for k in ("date", "commit", "command", "model")}
    if "float32_check" in b and "float32_check" not in a:  # run last, in the second call
        a["float32_check"] = b["float32_check"]
        a["float32_check_run"] = f"{b['commit']}, {b['device']}: {b['command']}"
    if "ctx4096" in a:
        a["first_token_ms_ctx4096"] = a["ctx4096"]["first_token_ms"]
    return a


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=None, help="a distilled draft folder (jaxspec distill)")
    ap.add_argument(
        "--feature", default=None, help="a feature draft folder: rows chain_feature, tree_feature"
    )
    add_vocab_args(ap, "the draft's chain and tree (rows chain_draft@N, tree_draft@N)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--peer", default=None, help="the PyTorch CUDA-graph peer's script")
    ap.add_argument("--no-f32", action="store_true", help="skip the float32 exactness check")
    ap.add_argument("--no-stream", action="store_true", help="skip the streaming overhead rows")
    ap.add_argument("--stream-steps", default="32", help="segment lengths to stream at")
    ap.add_argument(
        "--trees",
        default="",
        help="more tree shapes with the draft, DEPTHxWIDTHxBRANCHxBS comma-separated "
        "(rows tree_draft_<shape>; the default shape is the tree_draft row), or with the "
        "feature head as feature:DEPTHxWIDTHxBRANCHxBS (rows tree_feature_<shape>)",
    )
    ap.add_argument(
        "--random-weights",
        action="store_true",
        help="the streaming section only, on random SmolLM2-135M-shape weights (no GGUF)",
    )
    ap.add_argument(
        "--merge",
        nargs=2,
        default=None,
        metavar=("FIRST", "MORE"),
        help="FIRST's output with MORE's contexts added (two calls' runs), and stop",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.merge:
        return write("small_model.json", merged(*args.merge), args.out)
    gpu = jax.default_backend() == "gpu"
    if args.random_weights:
        model = random_target(SMOLLM2, dtype=jnp.bfloat16 if gpu else jnp.float32)
        ids = np.random.RandomState(0).randint(4, SMOLLM2.vocab_size, 1024 - args.new).tolist()
        payload = {
            **metadata(),
            "model": f"random SmolLM2-135M-shape weights ({model.dtype})",
            "new_tokens": args.new,
            "streaming": streaming(model, ids, args),
        }
        return write("small_model.json", payload, args.out)
    model = load(default_checkpoint(), dtype=jnp.bfloat16 if gpu else jnp.float32)
    model.kernels = KernelConfig.from_env()
    drafts = {"ngram": "ngram"}
    if args.draft:
        drafts["draft"] = load_draft(args.draft, model, vocab=args.draft_vocab)
        if args.compare_vocab != args.draft_vocab:  # the same draft with the other head
            other = "full" if args.compare_vocab is None else args.compare_vocab
            drafts[f"draft@{other}"] = load_draft(args.draft, model, vocab=args.compare_vocab)
    if args.feature:
        drafts["feature"] = load_draft(args.feature, model, vocab=args.draft_vocab)
    payload = {
        **metadata(),
        "model": f"SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to {model.dtype})",
        "new_tokens": args.new,
        "kernels": model.net().kernels.describe(),
        "runs": {
            n: {"method": m, "draft": k, **o}
            for n, m, k, o in RUNS + tree_runs(args.trees)
            if k in drafts
        },
        **({"draft_vocab": vocab_size_of(drafts["draft"]) or "full"} if args.draft else {}),
    }
    contexts = [int(c) for c in args.contexts.split(",") if c]
    # the first context's sections that compare (the peer, streaming, float32) come before the
    # other contexts, the peer first of them (an issue's key), and each is written as it ends,
    # so a call that runs out of time still holds them (on one H100, 258c7dd's run of the
    # runner's settings reached the end of the streaming rows in its 540 s, not the peer)
    got = run_context(model, drafts, contexts[0], args)
    ids_first = got.pop("ids")
    payload[f"ctx{contexts[0]}"] = got
    summarise(payload, contexts[0])
    write("small_model.json", payload, args.out)
    if args.peer:
        p = peer(args.peer, ids_first, args.new)
        if p is not None:
            payload["peer"] = p
            payload["peer_tok_per_s_b1"] = p["tok_per_s_whole_call"]
            payload["ar_over_peer"] = round(
                payload["ar_wall_tok_per_s_b1"] / p["tok_per_s_whole_call"], 3
            )
            write("small_model.json", payload, args.out)
    if not args.no_stream:
        ids = context_ids(model, contexts[0], args.new)
        payload["streaming"] = streaming(model, ids, args)
        write("small_model.json", payload, args.out)
    if not args.no_f32:
        payload["float32_check"] = float32_check(ids_first, args.new, f32_drafts(drafts, args))
    for ctx in contexts[1:]:
        write("small_model.json", payload, args.out)
        got = run_context(model, drafts, ctx, args)
        got.pop("ids", None)
        payload[f"ctx{ctx}"] = got
    if "ctx4096" in payload:
        payload["first_token_ms_ctx4096"] = payload["ctx4096"]["first_token_ms"]
    return write("small_model.json", payload, args.out)


if __name__ == "__main__":
    main()
