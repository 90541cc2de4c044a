"""Peers for ``jaxspec bench``: HF transformers ``generate`` on the same weights, prompts and
``max_new_tokens``, greedy, in the same run.

* ``hf``: plain greedy ``generate`` (eager attention, dynamic cache).
* ``hf-assisted``: HF assisted generation with the same draft: a draft checkpoint becomes HF's
  ``assistant_model`` (exported with ``hf_export``), drafting ``gamma`` tokens per verification
  (constant schedule, no confidence cut-off); the ``ngram`` draft becomes HF's prompt-lookup
  decoding (``prompt_lookup_num_tokens=gamma``, ``max_matching_ngram_size=ngram``). Other draft
  kinds have no HF counterpart: the row says so (``skipped``) instead of failing the run.

Both models are exported from jaxspec's own parameters (``hf_export.to_hf``), so a difference in
tokens (``jaxspec.measure.bench`` compares them with the reference run's) is a difference in
arithmetic, not in weights. Peers run one prompt at a time (HF's assisted generation takes batch 1
only), on the GPU when jax runs on one and torch sees CUDA, else on the CPU with torch's thread
count (recorded as ``threads``; ``OMP_NUM_THREADS`` sets it: on a CPU shared with other work one
thread can be many times faster than two), in the target's dtype. One warm-up ``generate`` is
excluded from the timings. Acceptance length here is new tokens per forward of the target.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from jaxspec.io import hf_export
from jaxspec.model.transformer import Model

PEERS = ("hf", "hf-assisted")


def _skipped(name: str, draft_name, why: str) -> dict:
    return {"method": name, "peer": True, "draft": draft_name, "skipped": why}


def run_peer(
    name: str,
    target,
    draft,
    draft_name,
    ids: list[list[int]],
    *,
    max_new: int,
    gamma: int,
    ngram: int,
    cache: dict,
    bar=None,
    over=lambda: False,
) -> dict:
    """One peer's row, in the bench JSON's per-method shape (plus ``peer``, ``device``)."""
    try:
        import torch
    except ImportError:
        return _skipped(name, draft_name, "torch is not installed (pip install torch)")
    if name == "hf-assisted" and not isinstance(draft, Model) and draft != "ngram":
        return _skipped(
            name, draft_name, f"HF has no assisted-generation counterpart of the {draft!r} draft"
        )
    device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    if "target" not in cache:
        cache["target"] = hf_export.to_hf(target, device=device)
    hf = cache["target"]
    eos = list(target.config.eos_token_ids)
    kw = _generate_kwargs(
        name, draft, cache, device, eos, max_new=max_new, gamma=gamma, ngram=ngram
    )
    forwards = [0]
    hook = hf.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    def one(prompt: list[int]) -> tuple[list[int], float, int]:
        x = torch.tensor([prompt], device=device)
        forwards[0] = 0
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(x, **kw)
        toks = out[0, len(prompt) :].tolist()  # waits for the device
        return _cut_at_eos(toks, eos), time.perf_counter() - t, forwards[0]

    try:
        t0 = time.perf_counter()
        one(ids[0])  # warm-up (excluded)
        warmup = time.perf_counter() - t0
        rows, wall, new, tokens = [], 0.0, 0, []
        for i, prompt in enumerate(ids):
            if rows and over():
                break
            toks, s, fw = one(prompt)
            tokens.append(toks)
            wall += s
            new += len(toks)
            rows.append(
                {
                    "prompt": i,
                    "prompt_tokens": len(prompt),
                    "new_tokens": len(toks),
                    "wall_s": round(s, 6),
                    "ms_per_token": round(1e3 * s / max(len(toks), 1), 4),
                    "acceptance_length": round(len(toks) / max(fw, 1), 4),
                }
            )
            if bar is not None:
                bar.update(1)
    finally:
        hook.remove()
    return _summary(
        name, rows, tokens, wall=wall, new=new, warmup=warmup, draft_name=draft_name,
        gamma=gamma, device=device, hf=hf, n_ids=len(ids),
    )  # fmt: skip


def _generate_kwargs(name, draft, cache, device, eos, *, max_new, gamma, ngram) -> dict:
    """HF ``generate``'s greedy keywords; for ``hf-assisted`` the same draft as the assistant
    model (a constant gamma, no confidence cut-off) or prompt lookup for ``ngram``."""
    kw = dict(
        max_new_tokens=max_new,
        do_sample=False,
        num_beams=1,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
    )
    if name != "hf-assisted":
        return kw
    if not isinstance(draft, Model):
        return {**kw, "prompt_lookup_num_tokens": gamma, "max_matching_ngram_size": ngram}
    if "draft" not in cache:
        cache["draft"] = hf_export.to_hf(draft, device=device)
    assistant = cache["draft"]
    knobs = dict(
        num_assistant_tokens=gamma,
        num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=0.0,
    )
    for k, v in knobs.items():
        setattr(assistant.generation_config, k, v)
    return {**kw, "assistant_model": assistant, **knobs}


def _summary(name, rows, tokens, *, wall, new, warmup, draft_name, gamma, device, hf, n_ids):
    """The peer's row in the bench JSON's per-method shape."""
    lat = [r["ms_per_token"] for r in rows]
    return {
        "method": name,
        "peer": True,
        "draft": draft_name if name == "hf-assisted" else None,
        "options": {"gamma": gamma} if name == "hf-assisted" else {},
        "device": device,
        **({"threads": torch_threads()} if device == "cpu" else {}),
        "dtype": str(next(hf.parameters()).dtype).removeprefix("torch."),
        "batch": 1,
        "tokens_per_s": round(new / wall, 3) if wall > 0 else None,
        "acceptance_length": round(statistics.mean(r["acceptance_length"] for r in rows), 4),
        "ms_per_token": {
            "mean": round(statistics.mean(lat), 4),
            "p50": round(float(np.percentile(lat, 50)), 4),
            "p95": round(float(np.percentile(lat, 95)), 4),
        },
        "time_split_s": {"warmup": round(warmup, 3), "run": round(wall, 6)},
        "new_tokens": new,
        **({"truncated": True} if len(rows) < n_ids else {}),
        "per_prompt": rows,
        "_tokens": tokens,
    }


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _cut_at_eos(toks: list[int], eos: list[int]) -> list[int]:
    """Up to and including the first EOS, as ``GenerationResult.tokens``."""
    for i, t in enumerate(toks):
        if t in eos:
            return toks[: i + 1]
    return toks
