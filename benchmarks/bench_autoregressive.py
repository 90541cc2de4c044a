"""Greedy autoregressive tokens/s of jaxspec vs HF transformers' eager ``generate`` on the same
real model (SmolLM2-135M-Instruct from its GGUF), prompt and length; jaxspec with the kernels of
the ``JAXSPEC_*`` variables (``kernels``).

    .venv/bin/python benchmarks/bench_autoregressive.py [--new 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.common import context_ids, default_dtype, default_target, ints, metadata, write  # noqa: E402
from jaxspec.api import generate  # noqa: E402
from jaxspec.io.default_model import default_gguf_path  # noqa: E402
from jaxspec.model.quantized import is_quantized_model  # noqa: E402

PROMPT = "Write a Python function that checks whether a number is prime."


def bench_jaxspec(new: int, repeats: int):
    """(tokens/s, the last result, the model, the first call's compile seconds)."""
    model = default_target()
    first = generate(model, PROMPT, chat=True, max_new_tokens=new)  # compiles
    times = []
    for _ in range(repeats):
        r = generate(model, PROMPT, chat=True, max_new_tokens=new)
        times.append(r.stats["wall_s"])
    n = r.stats["new_tokens"]
    return n / statistics.median(times), r, model, first.stats.compile_s


def bench_context(model, ctx: int, new: int, repeats: int) -> float:
    """Greedy tokens/s with a prompt of ``ctx - new`` tokens of real text (HumanEval prompts
    concatenated), so the cache holds about ``ctx`` tokens by the end."""
    ids = context_ids(model, ctx, new)
    generate(model, [ids], max_new_tokens=new)
    times = []
    for _ in range(repeats):
        r = generate(model, [ids], max_new_tokens=new)
        times.append(r.stats["wall_s"])
    return r.stats["new_tokens"] / statistics.median(times)


def bench_hf(gguf, ids: list[int], new: int, repeats: int, torch_dtype):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, __import__("os").cpu_count() or 1))
    # On the GPU machine HF runs on the GPU too (an earlier version of this script left it on
    # the host CPU, so its "H200" HF figure was a CPU one).
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf = (
        AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
        .to(dev)
        .eval()
    )
    x = torch.tensor([ids], device=dev)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    with torch.no_grad():
        hf.generate(x, **kw)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            out = hf.generate(x, **kw)
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    return new / statistics.median(times), out[0, len(ids) :].tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--contexts",
        default="1024,4096",
        help="also time jaxspec at these context lengths (real text prompts)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    gpu = jax.default_backend() == "gpu"
    tps, r, model, compile_s = bench_jaxspec(args.new, args.repeats)
    from jaxspec.prompts import encode_text

    ids = encode_text(model.tokenizer, PROMPT, chat=True)
    hf_tps, hf_tokens = bench_hf(
        default_gguf_path(), ids, args.new, args.repeats, getattr(torch, default_dtype().name)
    )
    ours = r.tokens[0]
    same = int(np.argmin(np.array(ours + [-1]) == np.array(hf_tokens[: len(ours)] + [-2])))
    payload = {
        **metadata(),
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1)",
        "jaxspec_weights": "kept quantized" if is_quantized_model(model) else "dequantized",
        "hf_weights": "dequantized (transformers' GGUF loader)",
        "kernels": model.net().kernels.describe(),
        "prompt": PROMPT,
        "new_tokens": r.stats["new_tokens"],
        "jaxspec_greedy_tok_per_s": round(tps, 1),
        "hf_eager_greedy_tok_per_s": round(hf_tps, 1),
        "speedup": round(tps / hf_tps, 2),
        "first_tokens_identical": same,
        "jaxspec_compile_s": round(compile_s, 1),
        "text": r.text[0][:400],
    }
    for ctx in ints(args.contexts):
        payload[f"jaxspec_greedy_tok_per_s_ctx{ctx}"] = round(
            bench_context(model, ctx, args.new, args.repeats), 1
        )
    dev = "gpu" if gpu else "cpu"
    write(f"ar_{dev}.json", payload, args.out)
    print(
        f"{'jaxspec':>10} {tps:8.1f} tok/s\n{'HF eager':>10} {hf_tps:8.1f} tok/s\n"
        f"{'speedup':>10} {tps / hf_tps:8.2f}x   identical first tokens: {same}"
    )


if __name__ == "__main__":
    main()
