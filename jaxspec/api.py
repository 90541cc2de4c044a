"""``jaxspec.api``: one entry point over every decoding method."""

from __future__ import annotations

import importlib

import numpy as np

from jaxspec.engines.base import GenerationResult, pad_prompts, trim
from jaxspec.errors import JaxspecError, OptionError
from jaxspec.model.transformer import Model
from jaxspec.prompts import check_context, encode_prompts
from jaxspec.spec.sampling import Sampling

METHODS = ("autoregressive", "chain", "tree", "swiftspec", "magicdec")


def generate(
    target: Model,
    prompts,
    *,
    draft=None,
    method: str = "autoregressive",
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    chat: bool = False,
    **method_options,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` per prompt with ``method``.

    prompts: a string, a list of strings, or a list of token-id lists (ragged lengths are fine).
    draft: a ``Model`` (same vocabulary), or "self-streaming", "self-snapkv", "ngram".
    chat: wrap string prompts in the tokenizer's chat template as one user turn.
    Every speculative method returns exactly the target's greedy tokens at temperature 0 and
    samples from the target's distribution otherwise.
    """
    if not isinstance(target, Model):
        raise OptionError(
            f"target must be a jaxspec.Model (from jaxspec.load), got {type(target).__name__}."
        )
    if method not in METHODS:
        raise OptionError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}.")
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise OptionError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise OptionError(f"seed must be an integer, got {seed!r}.")
    sampling = Sampling(float(temperature), float(top_p), top_k)
    cfg = target.config
    ids = encode_prompts(prompts, target.tokenizer, cfg, chat=chat)
    check_context([len(p) for p in ids], max_new_tokens, cfg)
    padded, lens = pad_prompts(ids)
    engine = importlib.import_module(f"jaxspec.engines.{method}")
    out, count, stats = engine.run(
        target,
        draft,
        padded,
        lens,
        max_new=max_new_tokens,
        sampling=sampling,
        eos=tuple(cfg.eos_token_ids),
        seed=seed,
        prompts=ids,
        **method_options,
    )
    tokens = trim(np.asarray(out), np.asarray(count))
    new = sum(len(t) for t in tokens)
    stats = {"method": method, "new_tokens": new, **stats}
    stats["tokens_per_s"] = new / stats["wall_s"] if stats["wall_s"] > 0 else float("inf")
    text = None
    if target.tokenizer is not None:
        text = [target.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return GenerationResult(tokens=tokens, text=text, stats=stats)


__all__ = ["generate", "GenerationResult", "JaxspecError", "METHODS"]
