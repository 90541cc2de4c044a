"""The autoregressive loop checks its stop condition every ``chunk_steps()`` steps (8 on GPU, 1
elsewhere). Forced chunks on CPU must change nothing: the tokens, per-row counts at EOS and the
step count equal the one-step loop's, greedy and sampled."""

import pytest

import jaxspec
from jaxspec.engines import autoregressive, common
from tests import tiny


def _run(monkeypatch, chunk, target, prompts, **kw):
    monkeypatch.setattr(autoregressive, "chunk_steps", lambda: chunk)
    common._COMPILED.clear()
    autoregressive.decode.clear_cache()
    r = jaxspec.generate(target, prompts, **kw)
    return r.tokens, r.stats["target_steps"]


@pytest.mark.parametrize("seed", range(3))
def test_chunked_loop_equals_one_step_loop(seed, monkeypatch):
    base = tiny.model(seed)
    prompts = tiny.prompts(seed, lengths=(11, 2, 6))
    ref = jaxspec.generate(base, prompts[:1], max_new_tokens=10).tokens[0]
    target = tiny.with_eos(base, ref[4])  # row 0 stops at its first ref[4]
    for kw in (dict(max_new_tokens=13), dict(max_new_tokens=13, temperature=0.9, seed=seed)):
        one = _run(monkeypatch, 1, target, prompts, **kw)
        if "temperature" not in kw:
            stop = ref.index(ref[4]) + 1
            assert one[0][0] == ref[:stop], "the EOS row did not stop where it should"
            assert len({len(row) for row in one[0]}) > 1, "rows should stop at different steps"
        for chunk in (3, 8):
            assert _run(monkeypatch, chunk, target, prompts, **kw) == one, (chunk, kw)
    autoregressive.decode.clear_cache()
