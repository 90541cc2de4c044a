"""The engines check their stop condition every ``chunk`` loop iterations (``base.until_done``:
8 steps for autoregressive decoding and 4 verifications for chain/tree at batch <= 8 on GPU, 1
elsewhere). Forced chunks on CPU (``KernelConfig(loop_chunk=...)``; the CLI's
``JAXSPEC_LOOP_CHUNK``) must change nothing: the tokens, the per-row counts at EOS, the step
counts and the acceptance lengths equal the one-step loop's, greedy and sampled, for every engine
and draft kind."""

import pytest

import jaxspec
from jaxspec import KernelConfig
from jaxspec.errors import OptionError
from tests import tiny


def _run(chunk, target, prompts, **kw):
    r = jaxspec.generate(target, prompts, kernels=KernelConfig(loop_chunk=chunk), **kw)
    keep = ("target_steps", "draft_steps", "acceptance_length")
    return r.tokens, {k: r.stats[k] for k in keep if k in r.stats}


def _eos_target(seed):
    base = tiny.model(seed)
    prompts = tiny.prompts(seed, lengths=(11, 2, 6))
    ref = jaxspec.generate(base, prompts[:1], max_new_tokens=10).tokens[0]
    return base, tiny.with_eos(base, ref[4]), prompts, ref  # row 0 stops at its first ref[4]


@pytest.mark.parametrize(
    "seed",
    # seeds 1 and 2 are the same runs at other weights and another EOS id (each its own
    # compiles): seed 0 checks the property on the same shapes and chunks; slow
    [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)],
)
def test_chunked_autoregressive_loop_equals_one_step_loop(seed):
    _, target, prompts, ref = _eos_target(seed)
    for kw in (dict(max_new_tokens=13), dict(max_new_tokens=13, temperature=0.9, seed=seed)):
        one = _run(1, target, prompts, **kw)
        if "temperature" not in kw:
            stop = ref.index(ref[4]) + 1
            assert one[0][0] == ref[:stop], "the EOS row did not stop where it should"
            assert len({len(row) for row in one[0]}) > 1, "rows should stop at different steps"
        for chunk in (3, 8):
            assert _run(chunk, target, prompts, **kw) == one, (chunk, kw)


@pytest.mark.parametrize(
    "method,draft,seed",
    # each method with a model draft and with a built-in one by default; chain + model and
    # tree + ngram are the same chunked loops over other drafts' programs (27-36 s): slow
    [
        ("chain", "ngram", 0),
        pytest.param("chain", "model", 1, marks=pytest.mark.slow),
        ("chain", "self-streaming", 2),
        pytest.param("tree", "ngram", 3, marks=pytest.mark.slow),
        ("tree", "model", 4),
    ],
)
def test_chunked_speculative_loops_equal_one_step_loop(method, draft, seed):
    base, target, prompts, _ = _eos_target(seed)
    d = tiny.perturbed(base, 0.3, seed) if draft == "model" else draft
    opts = dict(gamma=3) if method == "chain" else dict(depth=3, width=4, branch=2, bs=4)
    if draft == "self-streaming":
        opts.update(budget=20, sinks=2)
    for kw in (dict(max_new_tokens=15), dict(max_new_tokens=15, temperature=0.9, seed=seed)):
        kw = dict(kw, method=method, draft=d, **opts)
        one = _run(1, target, prompts, **kw)
        if "temperature" not in kw:  # rows stop at different steps; the one-step loop is lossless
            assert len({len(row) for row in one[0]}) > 1, "rows should stop at different steps"
            ar = jaxspec.generate(target, prompts, max_new_tokens=15).tokens
            assert one[0] == ar
        for chunk in (3,):
            assert _run(chunk, target, prompts, **kw) == one, (chunk, kw)


@pytest.mark.parametrize("bad", [0, 65, -1, True])
def test_bad_loop_chunk_is_a_clear_error(bad):
    with pytest.raises(OptionError, match="loop_chunk"):
        KernelConfig(loop_chunk=bad)


@pytest.mark.parametrize("bad", ["0", "x", "65", "-1"])
def test_bad_loop_chunk_variable_is_a_clear_error(bad):
    with pytest.raises(OptionError, match="JAXSPEC_LOOP_CHUNK"):
        KernelConfig.from_env({"JAXSPEC_LOOP_CHUNK": bad})
    assert KernelConfig.from_env({"JAXSPEC_LOOP_CHUNK": "3"}).loop_chunk == 3
