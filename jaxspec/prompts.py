"""Turning user prompts into token ids, with the checks that give clear errors."""

from __future__ import annotations

import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.errors import PromptError


def check_token_ids(tokens, cfg: ModelConfig) -> None:
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= cfg.vocab_size):
        bad = int(arr.min() if arr.min() < 0 else arr.max())
        raise PromptError(
            f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size}); "
            "pass ids produced by this model's tokenizer."
        )


def encode_prompts(prompts, tokenizer, cfg: ModelConfig, *, chat: bool = False) -> list[list[int]]:
    """``str`` | ``list[str]`` | ``list[list[int]]`` -> list of id lists, checked.

    With ``chat`` the tokenizer's chat template wraps each string as one user turn.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, list | tuple) or len(prompts) == 0:
        raise PromptError(
            "no prompts given: pass a string, a list of strings or a list of id lists."
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
            ids = encode_text(tokenizer, p, chat=chat)
        else:
            ids = [int(x) for x in np.asarray(p).reshape(-1)]
            if not ids:
                raise PromptError(f"prompt {i} is empty: give it at least one token id.")
        check_token_ids(ids, cfg)
        out.append(ids)
    return out


def encode_text(tokenizer, text: str, *, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(x) for x in ids]
    return [int(x) for x in tokenizer.encode(text)]


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
