"""Turning user prompts into token ids, with the checks that give clear errors."""

from __future__ import annotations

import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.errors import PromptError


def check_token_ids(tokens, cfg: ModelConfig) -> None:
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= cfg.vocab_size):
        bad = int(arr.min() if arr.min() < 0 else arr.max())
        raise PromptError(
            f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size}); "
            "pass ids produced by this model's tokenizer."
        )


def encode_prompts(prompts, tokenizer, cfg: ModelConfig, *, chat: bool = False) -> list[list[int]]:
    """Prompts -> a list of token-id lists, checked (``prompt_arrays``, as Python ints)."""
    return [a.tolist() for a in prompt_arrays(prompts, tokenizer, cfg, chat=chat)]


def prompt_arrays(prompts, tokenizer, cfg: ModelConfig, *, chat: bool = False) -> list[np.ndarray]:
    """Prompts -> one int32 array of token ids per prompt, checked.

    Takes a string, a list of strings, a flat list of token ids (ONE prompt, as HF's
    ``input_ids`` is), a list of id lists (ragged lengths are fine), or a 1-D / 2-D integer
    array (numpy or jax: one prompt, or one per row). With ``chat`` the tokenizer's chat template
    wraps each string as one user turn. Float ids are refused, never truncated.

    The ids stay in numpy from here to the padded batch (``prefill.pad_prompts`` copies
    arrays): through Python ints (a list of ids converted, listed again and copied into the
    batch) a warm call with a 4K-token prompt spent 0.2-0.25 ms more of host time on the 2-core
    CPU (benchmarks/notes/host_overhead.md).
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    elif hasattr(prompts, "shape") and hasattr(prompts, "dtype"):  # numpy / jax arrays
        prompts = _array_prompts(prompts)
    elif isinstance(prompts, list | tuple) and prompts and all(_is_id(x) for x in prompts):
        prompts = [prompts]  # a flat list of ids is one prompt
    if not isinstance(prompts, list | tuple) or len(prompts) == 0:
        raise PromptError(
            "no prompts given: pass a string, a list of strings, a list of token ids (one "
            "prompt), a list of id lists, or a 1-D / 2-D integer array."
        )
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p.strip():
                raise PromptError(f"prompt {i} is empty: give it some text.")
            if tokenizer is None:
                raise PromptError(
                    "this checkpoint has no tokenizer, so prompts must be lists of token ids."
                )
            arr = np.asarray(_text_ids(tokenizer, p, chat=chat), np.int64)
        else:
            arr = _id_array(p, i)
        check_token_ids(arr, cfg)
        out.append(arr.astype(np.int32))  # in the vocabulary, so int32 holds it
    return out


def _is_id(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _array_prompts(a) -> list:
    arr = np.asarray(a)
    if arr.ndim not in (1, 2):
        raise PromptError(
            f"a prompt array must be 1-D (one prompt) or 2-D (one per row), got shape {arr.shape}."
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise PromptError(
            f"token ids must be integers, got an array of {arr.dtype}: pass the tokenizer's ids "
            "(e.g. np.asarray(ids, np.int32))."
        )
    return [arr] if arr.ndim == 1 else list(arr)


def _id_array(p, i: int) -> np.ndarray:
    """One prompt's ids, flat, from a list, tuple or array of integers (floats and bools
    refused)."""
    arr = np.asarray(p)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise PromptError(
            f"prompt {i} must be text or integer token ids, got {type(p).__name__} of "
            f"{arr.dtype}: float ids are not truncated silently; pass the tokenizer's ids."
        )
    if not arr.size:
        raise PromptError(f"prompt {i} is empty: give it at least one token id.")
    return arr.reshape(-1)


def encode_text(tokenizer, text: str, *, chat: bool) -> list[int]:
    return [int(x) for x in _text_ids(tokenizer, text, chat=chat)]


def _text_ids(tokenizer, text: str, *, chat: bool):
    """The tokenizer's ids of ``text`` as it returns them (a sequence of integers)."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return ids["input_ids"] if hasattr(ids, "keys") else ids
    return tokenizer.encode(text)


def check_context(prompt_lens: list[int], max_new_tokens: int, cfg: ModelConfig, extra: int = 0):
    """A prompt plus its new tokens (plus the engine's block room) must fit the context."""
    limit = cfg.max_position_embeddings
    for i, n in enumerate(prompt_lens):
        if n + max_new_tokens + extra > limit:
            raise PromptError(
                f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens}"
                f"{f' and {extra} tokens of speculation room' if extra else ''} it exceeds the "
                f"model's context of {limit} tokens. Shorten the prompt or lower max_new_tokens."
            )
