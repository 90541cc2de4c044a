"""The long-document prompt set: real CPython text, cut to a requested token length."""

import pytest

from jaxspec.errors import OptionError
from jaxspec.io import datasets


class CharTokenizer:
    """One token per character (ids = code points), no chat template."""

    chat_template = None

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, **kw):
        return "".join(chr(i) for i in ids)


def test_longdoc_text_is_cpythons_language_reference():
    text = datasets.longdoc_text()
    assert len(text) > 300_000
    assert "The assert statement" in text or "assert_stmt" in text
    assert "PSF" in datasets.longdoc_source() and "pydoc_data" in datasets.longdoc_source()


def test_longdoc_prompts_have_the_requested_length_and_differ():
    tok = CharTokenizer()
    ps = datasets.longdoc_prompts(tok, 5, 3000, chat=False)
    assert [len(p) for p in ps] == [3000] * 5
    assert len({tuple(p[:100]) for p in ps}) == 5  # different starting places
    text = tok.decode(ps[0])
    assert text.endswith(datasets.LONGDOC_INSTRUCTION)
    assert text[:-200] in datasets.longdoc_text()  # a real cut of the text
    # more documents than the text holds: they overlap but still start at different places
    many = datasets.longdoc_prompts(tok, 300, 2000, chat=False)
    assert len({tuple(p[:50]) for p in many}) == 300
    with pytest.raises(OptionError, match="more than"):
        datasets.longdoc_prompts(tok, 1, 10, chat=False)


def test_load_longdoc():
    prompts, source = datasets.load("longdoc", 3)
    assert len(prompts) == 3 and source == datasets.longdoc_source()
    assert all(len(p.split(" ")) > 1000 for p in prompts)
    assert datasets.chat_template("longdoc")
