"""HF transformers on a model shape (random bf16 weights, made on the GPU): greedy decode
tokens/s at batch 1 after a prompt of ``--context`` tokens, with the dynamic cache (eager) and
with the static cache, for comparison with ``bench_decode_gpu.py`` on the same GPU.

    python benchmarks/bench_hf_shape.py --shape 8b --context 4096 --new 64 --out hf_8b.json
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.common import metadata, write  # noqa: E402

SHAPES = {
    "8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "smoke": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
    ),
}


def tok_per_s(model, ids, new: int, reps: int, **kw) -> float:
    import torch

    args = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)
    with torch.no_grad():
        model.generate(ids, **args)
        times = []
        for _ in range(reps):
            if ids.is_cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, **args)
            if ids.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    return new / sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cfg = LlamaConfig(**SHAPES[args.shape], torch_dtype=dtype)
    with torch.device(dev):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, args.context - args.new), device=dev)
    out = {**metadata(), "shape": args.shape, "context": args.context, "new_tokens": args.new}
    out["hf_dynamic_cache_tok_per_s"] = round(tok_per_s(model, ids, args.new, args.reps), 2)
    print("dynamic cache", out["hf_dynamic_cache_tok_per_s"], flush=True)
    try:
        out["hf_static_cache_tok_per_s"] = round(
            tok_per_s(model, ids, args.new, args.reps, cache_implementation="static"), 2
        )
    except Exception as e:  # recorded, not hidden: the static path has crashed here before
        out["hf_static_cache_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print("static cache", out.get("hf_static_cache_tok_per_s", out.get("hf_static_cache_error")))
    write(f"hf_{args.shape}.json", out, args.out)


if __name__ == "__main__":
    main()
