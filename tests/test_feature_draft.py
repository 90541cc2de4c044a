"""Feature drafts (EAGLE heads over the target's hidden states): the target returns its states
without changing its logits, the head drafts what it predicts on the whole sequence, and chain,
tree and magicdec return exactly the target's greedy tokens with it, at zero, partial and full
acceptance, over ragged batches.

The default run (about a minute of CPU) keeps what fails first when drafting breaks: the
target's states, greedy equality on two seeds for a chain, a tree and magicdec, full and zero
acceptance for a chain, the refusals. The rest (every shape on eight seeds, the drafts checked
against a from-scratch computation, full/zero acceptance in every shape) is ``slow``."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.api import generate
from jaxspec.engines import chain, tree
from jaxspec.errors import DraftError, OptionError
from jaxspec.model.feature_head import (
    SHARED,
    FeatureModel,
    apply_head,
    head_model,
    random_head,
)
from jaxspec.model.kv_cache import causal_block, init_cache
from jaxspec.model.prefill import prefill
from jaxspec.model.quantized import quantize_model
from jaxspec.model.transformer import FINAL, apply
from pallas_kernels import quant
from tests import tiny

SEEDS = range(8)
FEW_SEEDS = range(2)  # the default run's
NEW = 20
RAGGED = (13, 2, 7, 1)


def reference(target, ps, new=NEW):
    return generate(target, ps, max_new_tokens=new).tokens


def bigram(m, leak: float = 0.0):
    """``m`` with every layer's output projections scaled by ``leak``: at 0 each state is the
    normed embedding of the current token, so the next token is a function of the current one;
    a small leak lets the context in now and then."""
    pure = nnx.to_pure_dict(m.params)
    for layer in pure["layers"].values():
        for part, proj in (("self_attn", "o_proj"), ("mlp", "down_proj")):
            layer[part][proj]["kernel"] = leak * layer[part][proj]["kernel"]
    state = jax.tree.map(lambda x: x, m.params)
    nnx.replace_by_pure_dict(state, pure)
    return dataclasses.replace(m, params=state)


def copy_head(target, sign: float, mix: float = 0.0, seed: int = 0) -> FeatureModel:
    """A head whose state is ``sign * embed(next token)`` plus ``mix`` times a random function
    of the target's state and of the head's own attention: with a ``bigram`` target, +1 with
    no mix predicts every token (full acceptance), -1 none; on a random tiny target (nearly a
    bigram model) +1 predicts many."""
    h = random_head(target, seed=seed)
    own = {k: v for k, v in nnx.to_pure_dict(h.params).items() if k not in SHARED}
    d = target.config.hidden_size
    rand = mix * jax.random.normal(jax.random.key(seed), (d, d)) / np.sqrt(d)
    own["fc"]["kernel"] = jnp.concatenate([sign * jnp.eye(d), rand], axis=0)
    own["fc"]["bias"] = jnp.zeros((d,))
    layer = own["layers"][0]
    for part, proj in (("self_attn", "o_proj"), ("mlp", "down_proj")):
        layer[part][proj]["kernel"] = mix * layer[part][proj]["kernel"]
    return head_model(target, h.config, own, f"copy-head({sign}, {mix})")


def test_features_leave_the_logits_bitwise_and_are_what_the_head_reads():
    target, ps = tiny.model(0), tiny.prompts(0, lengths=(9,))
    net = target.net()
    tok = jnp.asarray(ps, jnp.int32)
    b, t = tok.shape
    cache = init_cache(target.config, b, t, jnp.float32)
    zero = jnp.zeros((b,), jnp.int32)
    block = causal_block(zero, zero, jnp.full((b,), t, jnp.int32), t)
    plain, c1 = jax.jit(lambda f: apply(net, f, tok, cache, block))(target.flat)
    logits, c2, feats = jax.jit(lambda f: apply(net, f, tok, cache, block, None, (0, FINAL)))(
        target.flat
    )
    assert np.array_equal(plain, logits)
    assert all(np.array_equal(x, y) for x, y in zip(c1.k + c1.v, c2.k + c2.v, strict=True))
    d = target.config.hidden_size
    assert feats.shape == (b, t, 2 * d)
    head = nnx.to_pure_dict(target.params)["lm_head"]["kernel"]
    np.testing.assert_allclose(feats[..., d:] @ head, logits, rtol=1e-5, atol=1e-5)
    # the prefill's states at every prompt position are the one-block forward's
    _, _, pre = prefill(net, target.flat, cache, tok, jnp.full((b,), t, jnp.int32), (FINAL,))
    np.testing.assert_allclose(pre, feats[..., d:], rtol=1e-5, atol=1e-5)


WIDTH = 64  # the whole-sequence reference runs at one padded width: one compile


@functools.partial(jax.jit, static_argnums=(0, 2))
def _whole(net, flat, head_net, head_flat, seq, toks, feats):
    """The target's states over ``seq [1, WIDTH]`` and the head's logits and states over the
    pairs ``(feats, toks)`` (both causal, so the padding after the real tokens changes
    nothing before it)."""
    zero, full = jnp.zeros((1,), jnp.int32), jnp.full((1,), WIDTH, jnp.int32)
    block = causal_block(zero, zero, full, WIDTH)
    _, _, f = apply(net, flat, seq, init_cache(net.cfg, 1, WIDTH), block, None, (FINAL,))
    logits, g, _ = apply_head(head_net, head_flat, toks, feats, init_cache(head_net.cfg, 1, WIDTH),
                              block)  # fmt: skip
    return f, logits, g


def whole_sequence_drafts(target, head, seq: list[int], gamma: int) -> list[int]:
    """What the head should draft after ``seq`` (whose last token the target has not run yet),
    computed on the whole sequence from scratch: the target's states after ``seq[:-1]``, each
    paired with the token that followed, then the head's own states fed back."""
    n = len(seq)
    pad = lambda x: jnp.asarray([x + [0] * (WIDTH - len(x))], jnp.int32)  # noqa: E731
    args = (target.net(), target.flat, head.net(), head.flat)
    zeros = jnp.zeros((1, WIDTH, target.config.hidden_size))
    f, _, _ = _whole(*args, pad(seq), pad([]), zeros)
    toks, feats, out = list(seq[1:]), f.at[:, n - 1 :].set(0.0), []
    for k in range(gamma):
        _, logits, g = _whole(*args, pad(seq), pad(toks), feats)
        out.append(int(jnp.argmax(logits[0, n - 2 + k])))
        toks.append(out[-1])
        feats = feats.at[:, n - 1 + k].set(g[:, n - 2 + k])
    return out


@pytest.mark.slow
def test_the_draft_proposes_what_the_head_predicts_on_the_whole_sequence():
    """Through init, several verifies with partial acceptance and their commits, each proposal
    (a chain's, a one-leaf tree's path) equals the head's drafts computed from scratch on the
    emitted sequence: the cache holds the target's states at the right positions and the
    drafts feed the head's own."""
    target = tiny.model(2)
    head = copy_head(target, 1.0, mix=0.01, seed=2)
    ids = tiny.prompts(2, lengths=(11,))[0]
    out = generate(target, [ids], draft=head, method="chain", gamma=3, max_new_tokens=NEW)
    prog = out.call.prog
    args = (target.flat, head.flat, *map(jnp.asarray, (out.call.ids, out.call.lens)), 0)
    init, propose, step = (jax.jit(f, static_argnums=0) for f in (chain.init, chain.propose,
                                                                    chain.step))  # fmt: skip
    s = init(prog, *args)
    accepted = []
    for _ in range(5):
        count = int(s.out.count[0])
        seq = ids + s.out.tokens[0, :count].tolist()
        x, _, _ = propose(prog, head.flat, s, s.key)
        assert x[0].tolist() == whole_sequence_drafts(target, head, seq, 3)
        s = step(prog, target.flat, head.flat, s)
        accepted.append(int(s.out.count[0]) - count - 1)
    assert 0 < max(accepted) and min(accepted) < 3, accepted  # partial acceptance exercised


@pytest.mark.slow
def test_the_tree_draft_grows_what_the_head_predicts_on_the_whole_sequence():
    """The tree form with one leaf and one child per expansion grows the greedy path the head
    predicts from scratch, through verifies and re-roots."""
    target = tiny.model(2)
    head = copy_head(target, 1.0, mix=0.01, seed=2)
    ids = tiny.prompts(2, lengths=(11,))[0]
    r = generate(target, [ids], draft=head, method="tree", depth=3, width=1, branch=1, bs=3,
                 max_new_tokens=NEW)  # fmt: skip
    prog = r.call.prog
    args = (target.flat, head.flat, *map(jnp.asarray, (r.call.ids, r.call.lens)), 0)
    init, grow, step = (jax.jit(f, static_argnums=0) for f in (tree.init, tree.grow, tree.step))
    s = init(prog, *args)
    for _ in range(4):
        count = int(s.out.count[0])
        seq = ids + s.out.tokens[0, :count].tolist()
        grown = grow(prog, head.flat, s.draft).tree
        assert grown.token[0, 1:4].tolist() == whole_sequence_drafts(target, head, seq, 3)
        s = step(prog, target.flat, head.flat, s)


def heads(target, seed):
    """A random head (zero acceptance, nearly) on a random target; odd seeds' read fused
    states (EAGLE-3's input: the first layer's output beside the final state)."""
    return random_head(target, seed=100 + seed, reads=(0, FINAL) if seed % 2 else (FINAL,))


CHAIN, TREE, MAGICDEC = (
    ("chain", {"gamma": 4}),
    ("tree", {"depth": 3, "width": 4, "branch": 2, "bs": 6}),
    ("magicdec", {"gamma": 3}),
)
FEW = [CHAIN, TREE, MAGICDEC]  # the default run's: one of each engine
METHODS = FEW + [
    ("chain", {"gamma": 1}),
    ("tree", {}),
    ("magicdec", {"shape": "tree", "depth": 2, "width": 2, "branch": 2, "bs": 3}),
]


def greedy_equals_autoregressive(method, opts, seeds):
    for seed in seeds:
        target, ps = tiny.model(seed), tiny.prompts(seed, lengths=RAGGED)
        r = generate(target, ps, draft=heads(target, seed), method=method, max_new_tokens=NEW,
                     **opts)  # fmt: skip
        assert r.tokens == reference(target, ps), seed


@pytest.mark.parametrize("method,opts", FEW)
def test_greedy_equals_autoregressive_random_heads_ragged(method, opts):
    greedy_equals_autoregressive(method, opts, FEW_SEEDS)


@pytest.mark.slow
@pytest.mark.parametrize("method,opts", METHODS)
def test_greedy_equals_autoregressive_random_heads_ragged_many_seeds(method, opts):
    greedy_equals_autoregressive(method, opts, SEEDS)


def slow_but(*default):
    """``METHODS`` as parameters, all but ``default`` marked slow."""
    marks = lambda m: () if m in default else (pytest.mark.slow,)  # noqa: E731
    return [pytest.param(*m, marks=marks(m)) for m in METHODS]


@pytest.mark.parametrize("method,opts", slow_but(CHAIN))
def test_greedy_full_partial_and_zero_acceptance(method, opts):
    """With a bigram target: the copy head accepts every draft (acceptance gamma + 1, or the
    tree's depth + 1), the negated one none (1.0), a noisy one some; always the same tokens."""
    full = {"chain": opts.get("gamma", 4) + 1, "magicdec": opts.get("gamma", 0) + 1}
    full["tree"] = opts.get("depth", tree.feature_shape()["depth"]) + 1
    if opts.get("shape") == "tree":
        full["magicdec"] = opts["depth"] + 1
    for seed in range(3):
        ps = tiny.prompts(seed, lengths=RAGGED)
        plain = tiny.model(seed)
        target = bigram(plain)
        got = {}
        for name, t, head in [
            ("full", target, copy_head(target, 1e4)),  # peaked: trees keep the best path
            ("zero", target, copy_head(target, -1e4)),
            ("some", plain, copy_head(plain, 1.0, mix=0.01, seed=seed)),
        ]:
            r = generate(t, ps, draft=head, method=method, max_new_tokens=NEW, **opts)
            assert r.tokens == reference(t, ps), (seed, name)
            got[name] = r.stats["acceptance_length"]
        assert got["full"] == pytest.approx(full[method], rel=0.15), got
        assert got["zero"] == 1.0 and 1.0 < got["some"] < got["full"], got


def test_a_feature_drafts_tree_is_deeper_where_its_shape_is_left_open():
    """Depth and bs left open: a feature head's tree takes its backend's ``FEATURE_SHAPE`` (4
    and 8 on a GPU, 5 and 11 on a CPU, a GPU's elsewhere), any other draft 3 and 8 everywhere;
    given values win for both."""
    open_ = tree.Options()
    assert open_.shape_for(feature=True, backend="gpu") == tree.TreeShape(4, 8, 4, 8)
    assert open_.shape_for(feature=True, backend="cpu") == tree.TreeShape(5, 8, 4, 11)
    assert open_.shape_for(feature=True, backend="tpu") == tree.TreeShape(4, 8, 4, 8)
    assert open_.shape_for(feature=True) == tree.TreeShape(**tree.feature_shape())
    for backend in ("gpu", "cpu"):
        assert open_.shape_for(feature=False, backend=backend) == tree.TreeShape(3, 8, 4, 8)
    assert open_.shape == open_.shape_for(feature=False) == tree.TreeShape(3, 8, 4, 8)
    given = tree.Options(depth=2, bs=5)
    assert given.shape_for(feature=True) == given.shape == tree.TreeShape(2, 8, 4, 5)
    with pytest.raises(OptionError, match="depth"):
        tree.Options(depth=0)
    target = tiny.model(0)
    r = generate(target, tiny.prompts(0, lengths=(5,)), draft=heads(target, 0), method="tree",
                 max_new_tokens=4, width=2, branch=2)  # fmt: skip
    want = tree.feature_shape()  # this backend's: (5, 11) in the CPU suite
    assert (r.stats["depth"], r.stats["bs"]) == (want["depth"], want["bs"])


def test_swiftspec_refuses_a_feature_draft_and_sparse_caches_are_refused():
    target, ps = tiny.model(0), tiny.prompts(0)
    head = heads(target, 0)
    with pytest.raises(DraftError, match="newest hidden states"):
        generate(target, ps, draft=head, method="swiftspec", target_devices=1, draft_devices=1,
                 depth=2)  # fmt: skip
    with pytest.raises(OptionError, match="dense cache"):
        generate(target, ps, draft=head, method="magicdec", gamma=2, sparse="streaming")
    with pytest.raises(OptionError, match="no logits of its own"):
        head.logits([[1, 2]])


@pytest.mark.slow
def test_magicdec_takes_a_feature_draft_with_the_dense_cache_named():
    target, ps = tiny.model(0), tiny.prompts(0)
    r = generate(target, ps, draft=heads(target, 0), method="magicdec", gamma=2, sparse="dense",
                 max_new_tokens=8)  # fmt: skip
    assert r.tokens == reference(target, ps, 8)


def test_a_head_for_another_hidden_size_is_a_draft_error():
    """(A head whose config says 48: building a model of new shapes costs seconds of eager
    compiles, and the check reads the config alone.)"""
    target = tiny.model(0)
    head = heads(target, 0)
    other = dataclasses.replace(head, config=dataclasses.replace(head.config, hidden_size=48))
    with pytest.raises(DraftError, match="states of size 48"):
        generate(target, tiny.prompts(0), draft=other, method="chain")


def test_a_head_over_a_quantized_target_shares_its_tables_dequantized():
    """The head indexes and multiplies the target's embedding and LM head as float arrays: a
    quantized target's are dequantized to its compute dtype (its greedy tokens with such a head:
    test_quantized_engines)."""
    target = quantize_model(tiny.model(0), 8)
    stored = target.params["lm_head"]["kernel"].get_value()
    assert quant.is_quantized(stored)
    head = random_head(target)
    table = head.params["lm_head"]["kernel"].get_value()
    assert not quant.is_quantized(table) and table.dtype == target.dtype
    want = quant.dequantize(stored, target.dtype)
    np.testing.assert_array_equal(np.asarray(table), np.asarray(want))


@pytest.mark.slow
def test_sampling_runs_with_a_feature_draft_and_is_seeded():
    """Sampling over a ragged batch: a seed gives the same tokens again, another seed others
    (the law itself: test_sampling_engines' chi-square tests)."""
    target, ps = tiny.model(4), tiny.prompts(4, lengths=RAGGED)
    head = copy_head(target, 1.0, mix=0.01)
    kw = dict(draft=head, max_new_tokens=12, temperature=0.8)
    for method, opts in [("chain", {"gamma": 3}), ("tree", {"depth": 2})]:
        a = generate(target, ps, method=method, seed=3, **kw, **opts).tokens
        assert a == generate(target, ps, method=method, seed=3, **kw, **opts).tokens
        assert all(len(t) == 12 for t in a)
        assert a != generate(target, ps, method=method, seed=4, **kw, **opts).tokens
