"""What ``generate`` takes as prompts and settings: arrays and flat id lists as HF users pass them,
and every bad value a clear ``JaxspecError`` naming it (never a truncated float, never inf)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from tests import tiny

TARGET = tiny.model(0)
IDS = [[5, 6, 7, 8], [9, 10, 11, 12]]


def tokens(prompts, **kw):
    return jaxspec.generate(TARGET, prompts, max_new_tokens=4, **kw).tokens


def test_integer_arrays_are_prompts_like_lists():
    ref = tokens(IDS)
    assert tokens(np.asarray(IDS, np.int32)) == ref
    assert tokens(jnp.asarray(IDS)) == ref
    assert tokens(np.asarray(IDS[0], np.int64)) == ref[:1]  # 1-D: one prompt


def test_every_prompt_form_becomes_the_same_int32_ids():
    """``prompt_arrays``: lists, tuples, arrays of any integer dtype (rows of a 2-D one, or
    mixed with lists in a ragged batch) give the same int32 ids, which pad into one batch."""
    from jaxspec.model.prefill import pad_prompts
    from jaxspec.prompts import prompt_arrays

    rng = np.random.default_rng(0)
    rows = [rng.integers(0, TARGET.config.vocab_size, n).tolist() for n in (7, 3, 12)]
    forms = [
        rows,
        [tuple(r) for r in rows],
        [np.asarray(r, np.uint16) for r in rows],
        [np.asarray(rows[0], np.int64), rows[1], jnp.asarray(rows[2])],
    ]
    want, want_lens = pad_prompts(rows, jaxspec.KernelConfig())
    for form in forms:
        got = prompt_arrays(form, None, TARGET.config)
        assert [a.dtype for a in got] == [np.int32] * 3
        assert [a.tolist() for a in got] == rows
        ids, lens = pad_prompts(got, jaxspec.KernelConfig())
        np.testing.assert_array_equal(ids, want)
        np.testing.assert_array_equal(lens, want_lens)
    square = np.asarray([rows[0][:3], rows[1]], np.int64)
    assert [a.tolist() for a in prompt_arrays(square, None, TARGET.config)] == square.tolist()
    assert [a.tolist() for a in prompt_arrays(tuple(rows[1]), None, TARGET.config)] == [rows[1]]


def test_a_flat_id_list_is_one_prompt():
    """HF's ``input_ids`` style: [1, 2, 3] is one prompt of three tokens, not three prompts."""
    r = jaxspec.generate(TARGET, IDS[0], max_new_tokens=4)
    assert len(r.tokens) == 1 and r.tokens == tokens([IDS[0]])


BAD_PROMPTS = [
    ([1.0, 2.0, 3.0], "integer token ids"),  # floats are refused, not truncated
    (np.asarray([[1.5, 2.0]]), "must be integers"),
    ([[1.9, 2.2]], "integer token ids"),
    (np.zeros((1, 2, 2), np.int32), "1-D"),
    ([], "no prompts"),
    ([[]], "empty"),
    (["  "], "empty"),
    ([[1, TARGET.config.vocab_size]], "outside the vocabulary"),
    ([[-1, 2]], "outside the vocabulary"),
    ([[2**40, 2]], "outside the vocabulary"),  # checked before the ids become int32
    (np.asarray([[2**32 + 5]], np.uint64), "outside the vocabulary"),
    (np.asarray([[True, False]]), "must be integers"),
    (None, "no prompts"),
    ({"a": 1}, "no prompts"),
    (["no tokenizer here"], "no tokenizer"),
]


@pytest.mark.parametrize("prompts, match", BAD_PROMPTS)
def test_bad_prompts_are_prompt_errors(prompts, match):
    with pytest.raises(jaxspec.PromptError, match=match):
        jaxspec.generate(TARGET, prompts, max_new_tokens=2)


BAD_SETTINGS = [
    (dict(temperature="hot"), "temperature must be a number"),
    (dict(temperature=math.inf), "temperature must be finite"),
    (dict(temperature=math.nan), "temperature must be finite"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=1.5), "top_k must be an integer"),
    (dict(top_k=-1), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(seed="x"), "seed"),
    (dict(seed=2**40), "seed"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(method="beam"), "unknown method"),
    (dict(method="chain", draft="ngarm"), "unknown draft 'ngarm'"),
    (dict(method="chain", gamma=0, draft="ngram"), "gamma must be a positive integer"),
    (dict(method="chain", draft="ngram", depth=2), "does not take option"),
    (dict(method="tree", draft="ngram", bs=1000), "bs must be at most"),
    (dict(method="magicdec", draft="ngram"), "sparse-KV draft"),
    (dict(method="magicdec"), "needs a sparse-KV draft"),
    (dict(method="magicdec", draft="self-streaming", shape="round"), "shape must be one of"),
    (dict(method="swiftspec", draft="self-streaming", loop="fast"), "loop must be one of"),
    (dict(method="autoregressive", draft="ngram"), "takes no draft"),
    (dict(kernels="fast"), "KernelConfig"),
]


@pytest.mark.parametrize("kw, match", BAD_SETTINGS, ids=[str(k) for k, _ in BAD_SETTINGS])
def test_bad_settings_are_errors_naming_the_setting(kw, match):
    with pytest.raises(jaxspec.JaxspecError, match=match):
        jaxspec.generate(TARGET, IDS, **{"max_new_tokens": 2, **kw})


def test_bad_kernel_config_values_name_the_field():
    for kw in (
        dict(attention="flash"),
        dict(fused_linear="yes"),
        dict(linear_tile=(48, 128, 4)),
        dict(attention_tile=(None, None, None, 0)),  # no warps
        dict(attention_tile=(128, 2, 128, 4, 1)),  # a fifth entry
        dict(prefill_chunk=100),
        dict(loop_chunk=0),
        dict(gemm_rows=-1),
        dict(row_padding="both"),
    ):
        with pytest.raises(jaxspec.OptionError, match=next(iter(kw))):
            jaxspec.KernelConfig(**kw)
    with pytest.raises(jaxspec.OptionError, match="needs a GPU"):
        jaxspec.KernelConfig(fused_attention="pallas").resolve(TARGET.config, backend="cpu")


def test_a_repeated_call_reuses_its_program_and_rechecks_what_differs():
    """``prepare`` keeps a call's static program per call signature (host time): the same call
    gets the same program and tokens; a value equal but of another type is still checked; new
    parameters or another draft kernel setting build a new program."""
    from jaxspec import api
    from jaxspec.model.transformer import truncate, with_params

    target = tiny.model(0)
    draft = truncate(target, 1)
    kw = dict(method="chain", draft=draft, max_new_tokens=4, gamma=2)
    first = jaxspec.generate(target, IDS, **kw)
    again = jaxspec.generate(target, [[1, 2, 3, 4], [5, 6, 7, 8]], **kw)
    assert again.call.prog is first.call.prog
    assert jaxspec.generate(target, IDS, **kw).tokens == first.tokens
    with pytest.raises(jaxspec.OptionError, match="gamma must be"):
        jaxspec.generate(target, IDS, **{**kw, "gamma": 2.0})
    draft.kernels = jaxspec.KernelConfig(attention="reference", fused_linear="off")
    assert api.prepare(target, IDS, **kw).prog is not first.call.prog
    moved = with_params(target, jax.tree.map(lambda x: x, target.params))
    assert api.prepare(moved, IDS, **kw).prog is not first.call.prog
    for i in range(api.KEPT_PROGRAMS + 2):  # the most recent are kept, no more
        api.prepare(target, IDS, method="autoregressive", max_new_tokens=4 + i)
    assert len(target._cache[api._PROGRAMS]) == api.KEPT_PROGRAMS


def test_a_model_made_by_replace_keeps_its_program_from_call_to_call():
    """``dataclasses.replace(model, params=...)`` (how tests make a perturbed draft) gives a model
    with its own derived values: sharing the target's made the two evict each other's flat
    weights at every call, so no program was ever kept for a draft made that way."""
    import dataclasses

    target = tiny.model(0)
    draft = dataclasses.replace(target, params=jax.tree.map(lambda x: 0.9 * x, target.params))
    assert draft._cache is not target._cache
    kw = dict(method="chain", draft=draft, max_new_tokens=4, gamma=2)
    jaxspec.generate(target, IDS, **kw)
    first = jaxspec.generate(target, IDS, **kw)
    assert jaxspec.generate(target, IDS, **kw).call.prog is first.call.prog


def test_tune_host_is_applied_once_and_says_whether_it_changed_anything():
    import platform

    assert jaxspec.tune_host() is jaxspec.tune_host()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert jaxspec.tune_host() is True
