"""``jaxspec.stream``: the pieces of every method join to exactly ``generate``'s tokens and text,
arrive as the loop runs (not all at the end), and hold back a character whose bytes are split
across tokens."""

import dataclasses

import numpy as np
import pytest

import jaxspec
from jaxspec.api import IncrementalText
from tests import tiny

# ids -> bytes: ASCII, UTF-8 lead bytes (2, 3 and 4-byte characters) and continuation bytes, so a
# random model writes split characters, complete ones and invalid sequences alike
BYTES = [*b"abcdefghij klmnop\n", 0xC3, 0xC3, 0xE2, 0xF0, 0x9F, *range(0x80, 0xBF, 2)]


class ByteTokenizer:
    """A byte-level decoder, as byte-level BPE decodes (invalid bytes become U+FFFD)."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(BYTES[i % len(BYTES)] for i in ids).decode("utf-8", errors="replace")


def _joined(stream, rows: int):
    tokens, text, pieces = [[] for _ in range(rows)], [""] * rows, [0] * rows
    for p in stream:
        tokens[p.index] += p.tokens
        text[p.index] += p.text
        pieces[p.index] += 1
    return tokens, text, pieces


@pytest.fixture(scope="module")
def models():
    target = dataclasses.replace(tiny.with_eos(tiny.model(3), 9), tokenizer=ByteTokenizer())
    draft = dataclasses.replace(tiny.perturbed(target, 0.05, 1), tokenizer=None)
    return target, draft


# every method greedy; sampled once (the key threads through the state across segments as it
# does through the one loop: a chain shows it, and every engine keeps its key the same way)
METHODS = [
    ("autoregressive", {}, 0.0),
    ("chain", {"gamma": 3}, 0.0),
    ("chain", {"gamma": 3}, 1.0),
    ("tree", {"depth": 2, "width": 4}, 0.0),
    ("magicdec", {"draft": "self-streaming", "gamma": 2, "budget": 24}, 0.0),
    ("swiftspec", {"target_devices": 1, "draft_devices": 1, "depth": 2}, 0.0),
]


@pytest.mark.parametrize(
    "method,options,temperature", METHODS, ids=[f"{m}-t{t:g}" for m, _, t in METHODS]
)
def test_streamed_pieces_join_to_the_generated_tokens_and_text(
    models, method, options, temperature
):
    target, draft = models
    kw = {"draft": draft, **options} if method != "autoregressive" else {}
    args = dict(method=method, max_new_tokens=14, temperature=temperature, seed=5, **kw)
    prompts = tiny.prompts(3)
    ref = jaxspec.generate(target, prompts, **args)
    s = jaxspec.stream(target, prompts, **args)
    tokens, text, pieces = _joined(s, len(prompts))
    assert tokens == ref.tokens == s.result.tokens
    assert text == ref.text == s.result.text
    assert s.result.stats["new_tokens"] == ref.stats["new_tokens"]
    assert s.result.stats["target_steps"] == ref.stats["target_steps"]
    if method == "swiftspec":  # its host-threaded loop yields once, at the end
        assert max(pieces) <= 2
    else:  # one loop iteration a segment on CPU: pieces as tokens are accepted
        assert max(pieces) > 2


@pytest.mark.parametrize("steps", [1, 3, 64])
def test_any_segment_length_gives_the_same_tokens(models, steps):
    target, draft = models
    prompts = tiny.prompts(4, lengths=(5, 9))
    for method, kw in (("autoregressive", {}), ("chain", {"draft": "ngram", "gamma": 2})):
        ref = jaxspec.generate(target, prompts, method=method, max_new_tokens=20, **kw)
        s = jaxspec.stream(
            target, prompts, method=method, max_new_tokens=20, segment_steps=steps, **kw
        )
        tokens, _, pieces = _joined(s, len(prompts))
        assert tokens == ref.tokens, (method, steps)
        if steps == 64:  # the whole loop in one segment: the prefill's token, then the rest
            assert max(pieces) <= 3


def test_a_bad_segment_length_is_an_option_error(models):
    with pytest.raises(jaxspec.OptionError, match="segment_steps"):
        jaxspec.stream(models[0], tiny.prompts(0), segment_steps=0)


def _pieces_of(tokenizer, ids):
    inc = IncrementalText(tokenizer)
    pieces = [inc.add(ids[: i + 1]) for i in range(len(ids))]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    return pieces + [inc.finish(full)], full


def test_a_character_split_across_tokens_is_held_back():
    text = "héllo wörld → 🎉 ok"
    raw = list(text.encode())

    class Raw:  # token i is byte i of the text
        def decode(self, ids, skip_special_tokens=False):
            return bytes(raw[i] for i in ids).decode("utf-8", errors="replace")

    pieces, full = _pieces_of(Raw(), list(range(len(raw))))
    assert full == text and "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[raw.index(0xF0)] == ""  # the emoji's first byte alone: nothing yet


def test_real_tokenizer_pieces_join_to_its_decoding():
    from jaxspec.io.default_model import default_gguf_path
    from jaxspec.io.gguf import GGUFSource

    tok = GGUFSource(default_gguf_path()).tokenizer()  # SmolLM2's byte-level BPE
    ids = tok.encode("Grüße, naïve café: 東京 🎉🎉 — done.\n  def f(x):\treturn x")
    pieces, full = _pieces_of(tok, ids)
    assert "".join(pieces) == full
    assert not any("\ufffd" in p for p in pieces)
    assert sum(bool(p) for p in pieces) > len(ids) // 2  # text flows, it is not held to the end
    rng = np.random.RandomState(0)
    noise = rng.randint(0, tok.vocab_size, 64).tolist()  # whatever a model may write
    pieces, full = _pieces_of(tok, noise)
    assert "".join(pieces) == full


def test_a_piece_never_waits_for_the_next_segments_launch(models, monkeypatch):
    """On a GPU launching a segment holds the launching thread until its loop ends. Here every
    segment's launch blocks until the consumer holds the piece before it: a stream that launched
    the next segment on the consumer's thread before handing out the last piece would deadlock
    (the launch times out and the stream raises); the worker-thread launches let it finish."""
    import threading

    from jaxspec.engines import base, programs

    target = models[0]
    received, launches = threading.Semaphore(0), []
    real = programs.compiled

    def compiled(fn, *a, **kw):
        exe, seconds = real(fn, *a, **kw)
        if fn is not base._stream_segment:
            return exe, seconds

        def launch(*args):
            launches.append(threading.current_thread().name)
            if not received.acquire(timeout=30):  # the piece before this segment's
                raise TimeoutError("a segment launch waited for a piece that never came")
            return exe(*args)

        return launch, seconds

    monkeypatch.setattr(programs, "compiled", compiled)
    prompts = tiny.prompts(1, lengths=(9,))  # one row: a piece per segment
    ref = jaxspec.generate(target, prompts, max_new_tokens=6)
    s = jaxspec.stream(target, prompts, max_new_tokens=6, segment_steps=1)
    tokens = []
    for p in s:
        tokens += p.tokens
        if p.tokens:
            received.release()
    assert tokens == ref.tokens[0]
    assert len(launches) >= len(tokens) - 1 >= 4  # a launch per step after the prefill's token
    assert set(launches) == {"jaxspec-stream"}
