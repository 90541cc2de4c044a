"""The tokenizer jaxspec loads without transformers (``jaxspec.io.tokenizer``) gives exactly
transformers' ids, text and chat prompts for the same folder, and hands anything else to it."""

import json

import pytest

from jaxspec.io import tokenizer
from jaxspec.io.datasets import chat
from jaxspec.io.default_model import default_gguf_path
from jaxspec.io.gguf import GGUFSource
from jaxspec.io.hf import load_tokenizer
from tests import hf_fixtures

EDGES = ["", " ", "  two leading", "tab\there", "héllo wörld ✓ 日本語", "a\n\nb\r\n", "x" * 300]


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory):
    """SmolLM2's byte-level BPE, saved as jaxspec saves a GGUF's tokenizer."""
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    GGUFSource(default_gguf_path()).tokenizer().save_pretrained(folder)
    return folder


def _same(fast, ref, texts):
    assert isinstance(fast, tokenizer.Tokenizer)
    for text in texts:
        ids = ref.encode(text)
        assert fast.encode(text) == ids, text
        assert fast.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        )
        assert fast.decode(ids) == ref.decode(ids), text
        assert fast.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )
        if ref.chat_template:
            chat_ = [{"role": "user", "content": text}]
            want = ref.apply_chat_template(chat_, add_generation_prompt=True, tokenize=True)
            want = want["input_ids"] if hasattr(want, "keys") else want
            got = fast.apply_chat_template(chat_, add_generation_prompt=True, tokenize=True)
            assert got == list(want), text
            assert fast.apply_chat_template(chat_, tokenize=False) == ref.apply_chat_template(
                chat_, tokenize=False
            )
    assert len(fast) == len(ref) and fast.eos_token_id == ref.eos_token_id


def test_smollm2s_tokenizer_reads_as_transformers_reads_it(smollm2_folder):
    fast = load_tokenizer(str(smollm2_folder))
    _same(fast, fast.hf, chat() + EDGES + ["<|im_start|>user\nhi<|im_end|>"])
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert fast.apply_chat_template(system, tokenize=False) == fast.hf.apply_chat_template(
        system, tokenize=False
    )


def test_the_fixture_word_tokenizer_reads_as_transformers_reads_it(tmp_path):
    hf_fixtures.make_tokenizer().save_pretrained(tmp_path)
    fast = load_tokenizer(str(tmp_path))
    _same(fast, fast.hf, ["w3 w4 w5", "w1", "unknown words here", ""])


def test_what_it_does_not_do_itself_goes_to_transformers(smollm2_folder):
    fast = load_tokenizer(str(smollm2_folder))
    assert "hf" not in vars(fast)  # loading it did not load transformers' tokenizer
    assert fast.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert "hf" in vars(fast)
    assert fast("hi")["input_ids"] == fast.hf("hi")["input_ids"]


def test_a_config_it_does_not_follow_loads_transformers_tokenizer(tmp_path):
    hf_fixtures.make_tokenizer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer.plain(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert not tokenizer.plain(tmp_path)
    assert not isinstance(load_tokenizer(str(tmp_path)), tokenizer.Tokenizer)
