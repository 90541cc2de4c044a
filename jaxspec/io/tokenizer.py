"""A checkpoint's tokenizer without importing transformers on the way to the first token.

transformers' import alone took 1.0-1.5 s of a warm ``jaxspec generate`` on the 2-core CPU
(cProfile, benchmarks/notes/warm_start_cpu.md): more than the decoding. A plain fast tokenizer
(``tokenizer.json``, as jaxspec saves a GGUF's and transformers saves a fast one) needs none of
it for what generation does: ``encode``, ``decode`` and the chat prompt. ``Tokenizer`` does those
through the ``tokenizers`` library and jinja2, as transformers' ``TokenizersBackend`` does
(``tokenization_utils_tokenizers.py``; its chat prompt: ``render_jinja_template`` in
``utils/chat_template_utils.py``, a sandboxed jinja2 environment with ``trim_blocks`` and
``lstrip_blocks``, its ``tojson`` and ``raise_exception``, and the special tokens as variables).
Anything else (other arguments, other methods) goes to transformers' tokenizer of the same
folder, loaded on first use, so the object stands in for it. tests/test_tokenizer.py holds the
two to the same ids and text.
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# tokenizer_config.json keys this class follows; any other makes ``plain`` false (transformers
# then loads the folder): add_bos_token / add_eos_token rewrite the post-processor, for example
_KNOWN = {
    "backend", "tokenizer_class", "model_max_length", "chat_template", "added_tokens_decoder",
    "bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token",
    "additional_special_tokens", "extra_special_tokens", "clean_up_tokenization_spaces",
}  # fmt: skip
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")
_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def plain(folder: pathlib.Path) -> bool:
    """Whether ``folder`` holds a plain fast tokenizer this class reads exactly."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        (folder / "tokenizer.json").is_file()
        and config.get("tokenizer_class") in _PLAIN_CLASSES
        and set(config) <= _KNOWN
        and not config.get("clean_up_tokenization_spaces")
    )


class Tokenizer:
    """The tokenizer of ``folder`` (``plain``): ``encode``, ``decode``, ``apply_chat_template``
    and ``len`` here, anything else from transformers' own (loaded on first use by ``hf``)."""

    def __init__(self, folder: str | pathlib.Path, hf):
        folder = pathlib.Path(folder)
        self._backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        self._special = {k: _text(config[k]) for k in _SPECIAL if config.get(k) is not None}
        template = folder / "chat_template.jinja"
        self.chat_template = (
            template.read_text() if template.is_file() else config.get("chat_template")
        )
        self._load_hf = hf

    @functools.cached_property
    def hf(self):
        """transformers' tokenizer of the same folder."""
        return self._load_hf()

    def __getattr__(self, name: str):  # only names not found on this object
        if name.startswith("__") or name in ("hf", "_load_hf"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __call__(self, *args, **kwargs):  # a special method: not found through __getattr__
        return self.hf(*args, **kwargs)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        eos = self._special.get("eos_token")
        return None if eos is None else self._backend.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs:
            return self.hf.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        ids = [int(i) for i in getattr(ids, "tolist", lambda: ids)()]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, conversation, add_generation_prompt: bool = False, tokenize: bool = True, **kwargs
    ):
        """A conversation (a list of ``{"role", "content"}`` dicts) as the model's chat prompt:
        its ids (``tokenize``) or its text."""
        simple = isinstance(conversation, list) and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in conversation
        )
        if kwargs or not simple or self.chat_template is None:
            return self.hf.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                **kwargs,
            )  # fmt: skip
        text = _compiled(self.chat_template).render(
            messages=[dict(m) for m in conversation],
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
            **self._special,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _text(token) -> str:
    """A special token as tokenizer_config.json writes it: a string, or a dict with its text."""
    return token["content"] if isinstance(token, dict) else str(token)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.cache
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)
