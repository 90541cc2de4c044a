"""The feature head's training-time test (``train.feature``, ``ttt_steps``): step j of the
training forward computes, at every position where it counts, exactly what a drafting head
computes at its j-th draft step (a cache of true pairs, then its own predicted states); the
block it sees is that and nothing more; a distill with it trains from a finished head
(``init_from``), or from a shallower one grown deeper; and the options refuse what they cannot
do."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.errors import OptionError
from jaxspec.model.feature_head import apply_head, random_head
from jaxspec.model.kv_cache import causal_block, init_cache
from jaxspec.train import distill as D
from jaxspec.train.feature import ttt_block, ttt_forward
from jaxspec.train.init_from import grown
from tests import tiny
from tests.test_feature_distill import PROMPTS, RUN


@pytest.fixture(scope="module")
def target():
    return tiny.model(0)


def drafted(head, tokens, feats, start: int, steps: int):
    """What a drafting head computes: true pairs ``< start`` in its cache, then ``steps`` + 1
    draft steps from the true state at ``start``, each feeding the last predicted state with the
    next token. Returns the last step's (logits, state), ``[B, V]`` and ``[B, d]``."""
    net, flat = head.net(), head.flat
    b = tokens.shape[0]
    cache = init_cache(net.cfg, b, tokens.shape[1], net.dtype)
    zeros = jnp.zeros((b,), jnp.int32)
    if start > 0:
        block = causal_block(zeros, zeros, jnp.full((b,), start, jnp.int32), start)
        cache = apply_head(net, flat, tokens[:, :start], feats[:, :start], cache, block)[2]
        cache = dataclasses.replace(cache, length=cache.length + start)
    state = feats[:, start : start + 1]
    for i in range(steps + 1):
        pos = jnp.full((b,), start + i, jnp.int32)
        block = causal_block(cache.length, pos, jnp.ones((b,), jnp.int32), 1)
        tok = tokens[:, start + i : start + i + 1]
        logits, state, cache = apply_head(net, flat, tok, state, cache, block)
        cache = dataclasses.replace(cache, length=cache.length + 1)
    return logits[:, 0], state[:, 0]


def test_each_ttt_step_computes_what_the_drafting_head_computes(target):
    head = random_head(target, layers=1, seed=3)
    rng = np.random.RandomState(7)
    b, n, steps = 2, 9, 3
    tokens = jnp.asarray(rng.randint(0, target.config.vocab_size, (b, n)), jnp.int32)
    feats = jnp.asarray(rng.normal(size=(b, n, target.config.hidden_size)), jnp.float32)
    logits, g = jax.jit(ttt_forward, static_argnums=(0, 4))(
        head.net(), head.flat, tokens, feats, steps
    )
    for j in range(steps):
        for t in sorted({j, j + 1, n // 2, n - 1}):  # the first positions that count, and later
            want_logits, want_g = drafted(head, tokens, feats, t - j, j)
            np.testing.assert_allclose(g[:, j * n + t], want_g, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(logits[:, j * n + t], want_logits, rtol=1e-5, atol=1e-5)


def test_a_ttt_step_sees_the_true_prefix_and_its_own_earlier_steps_only():
    n, steps = 6, 3
    mask = np.asarray(ttt_block(1, n, steps).block_mask[0])
    for j in range(steps):
        for t in range(n):
            seen = {(i, s) for i in range(steps) for s in range(n) if mask[j * n + t, i * n + s]}
            want = {(0, s) for s in range(t - j + 1)} | {
                (i, t - j + i) for i in range(1, j + 1) if t - j + i >= 0
            }
            assert seen == want, (j, t)
    assert np.array_equal(mask[:n, :n], np.tril(np.ones((n, n), bool)))  # step 0: causal


def test_a_ttt_run_goes_on_from_a_finished_head_and_reports_each_steps_agreement(target, tmp_path):
    first = D.distill(target, tmp_path / "a", prompts=PROMPTS, steps=12, save_every=50, **RUN)
    # one step: the last step's agreement is the first's
    assert all(r["agree_last"] == pytest.approx(r["agree"]) for r in first.history)
    run = D.distill(target, tmp_path / "b", prompts=PROMPTS, steps=12, save_every=50,
                    ttt_steps=3, init_from=str(first.path), **RUN)  # fmt: skip
    h = run.history
    assert run.steps == 12 and all(np.isfinite(r["loss"]) for r in h)
    assert all(0.0 <= r["agree_last"] <= 1.0 for r in h)
    # it starts where the finished head ended, not from a random head's loss
    assert h[0]["kl"] < 0.9 * first.history[0]["kl"]
    assert run.path.joinpath("draft.json").read_text().count('"ttt_steps": 3') == 1


@pytest.mark.parametrize(
    "options, says",
    [
        (dict(kind="model", ttt_steps=2), "training-time test"),
        (dict(kind="feature", ttt_steps=0), "ttt_steps must be an integer >= 1"),
    ],
)
def test_ttt_options_that_cannot_run_are_refused(target, tmp_path, options, says):
    run = {**RUN, **options}
    with pytest.raises(OptionError, match=says):
        D.distill(target, tmp_path / "run", prompts=PROMPTS, steps=2, **run)


def test_init_from_a_head_of_another_shape_is_refused(target, tmp_path):
    first = D.distill(target, tmp_path / "a", prompts=PROMPTS, steps=2, save_every=50, **RUN)
    with pytest.raises(OptionError, match="MLP width 32"):
        D.distill(target, tmp_path / "b", prompts=PROMPTS, steps=2, init_from=str(first.path),
                  **{**RUN, "intermediate": 16})  # fmt: skip


def test_a_grown_head_computes_what_the_shallower_one_did(target):
    """``init_from.grown``: a 1-layer head deepened to 3 layers (its own layer first, then two
    whose output projections are zero) gives the same logits and states at every step of a
    draft, and its added layers are not the identity once those projections are not zero."""
    from jaxspec.model.feature_head import head_config, head_model
    from jaxspec.train.feature import init_head
    from jaxspec.train.recipe import Recipe

    small = random_head(target, layers=1, intermediate=32, seed=5)
    pure = nnx.to_pure_dict(small.params)
    own = {k: v for k, v in pure.items() if k not in ("embed_tokens", "lm_head")}
    fresh = init_head(target, Recipe(kind="feature", layers=3, intermediate=32, init="random"))
    deep_own = grown(own, fresh)
    assert sorted(deep_own["layers"]) == [0, 1, 2]
    cfg = head_config(target.config, 3, 32)
    deep = head_model(target, cfg, deep_own, "grown")
    rng = np.random.RandomState(11)
    b, n = 2, 7
    tokens = jnp.asarray(rng.randint(0, target.config.vocab_size, (b, n)), jnp.int32)
    feats = jnp.asarray(rng.normal(size=(b, n, target.config.hidden_size)), jnp.float32)
    for start, steps in ((0, 3), (3, 2)):
        want = drafted(small, tokens, feats, start, steps)
        got = drafted(deep, tokens, feats, start, steps)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # the negative control: an added layer with its projections open changes the output
    opened = jax.tree.map(lambda x: x, deep_own)
    layer = opened["layers"][2]["self_attn"]["o_proj"]
    layer["kernel"] = fresh["layers"][2]["self_attn"]["o_proj"]["kernel"]
    changed = drafted(head_model(target, cfg, opened, "opened"), tokens, feats, 3, 2)
    assert not np.allclose(np.asarray(changed[1]), np.asarray(want[1]))


def test_a_distill_grows_a_finished_head_and_refuses_a_deeper_one(target, tmp_path):
    first = D.distill(target, tmp_path / "a", prompts=PROMPTS, steps=12, save_every=50, **RUN)
    run = D.distill(target, tmp_path / "b", prompts=PROMPTS, steps=4, save_every=50,
                    init_from=str(first.path), **{**RUN, "layers": 2})  # fmt: skip
    assert run.steps == 4 and all(np.isfinite(r["loss"]) for r in run.history)
    # its first step's loss is the 1-layer head's on the same batch (the grown head computes
    # what it did), not a fresh head's
    same = D.distill(target, tmp_path / "s", prompts=PROMPTS, steps=1, save_every=50,
                     init_from=str(first.path), **RUN)  # fmt: skip
    assert run.history[0]["kl"] == pytest.approx(same.history[0]["kl"], rel=1e-5)
    assert run.history[0]["kl"] < 0.95 * first.history[0]["kl"]
    with pytest.raises(OptionError, match="--layers no fewer than its"):
        D.distill(target, tmp_path / "c", prompts=PROMPTS, steps=2, init_from=str(run.path),
                  **RUN)  # fmt: skip


def test_the_loss_of_k_steps_against_one_broadcast_teacher_is_the_tiled_ones():
    """``feature_losses`` with the teacher's ``[B, 1, n, ...]`` against the K steps' ``[B, K, n,
    ...]`` (the training step's, no tiled copy) gives the losses of the teacher tiled K times."""
    from jaxspec.train.feature import feature_losses
    from jaxspec.train.recipe import Recipe

    rng = np.random.RandomState(5)
    b, k, n, d, v = 2, 3, 7, 8, 40
    teacher = jnp.asarray(rng.normal(size=(b, 1, n, v)) * 3, jnp.float32)
    states = jnp.asarray(rng.normal(size=(b, 1, n, d)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(b, k, n, v)) * 3, jnp.float32)
    g = jnp.asarray(rng.normal(size=(b, k, n, d)), jnp.float32)
    recipe = Recipe(kind="feature", init="random")
    got = feature_losses(teacher, states, head, g, recipe)
    tiled = feature_losses(
        jnp.tile(teacher, (1, k, 1, 1)), jnp.tile(states, (1, k, 1, 1)), head, g, recipe
    )
    for x, y in zip(got, tiled, strict=True):
        assert x.shape == (b, k, n)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
    # the steps differ (a control: each step is compared with its own head outputs)
    assert not np.allclose(np.asarray(got[1][:, 0]), np.asarray(got[1][:, 1]))
