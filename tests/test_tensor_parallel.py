"""The explicit tensor-parallel step (KernelConfig(tensor_parallel="shard_map")): greedy-equal to
one device for every engine and degree, exactly the collectives it writes in the compiled HLO,
and the split vocabulary read without gathering it (argmax, Gumbel-max sampling, top-k)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxspec import KernelConfig
from jaxspec.api import generate
from jaxspec.engines import autoregressive, base, tree
from jaxspec.errors import OptionError
from jaxspec.model import feature_head, sharding, tensor_parallel
from jaxspec.model import quantized as Q
from jaxspec.model.transformer import FINAL, Net
from jaxspec.model.vocab_head import with_vocab
from jaxspec.spec.sampling import Sampling
from tests import tiny

TP = KernelConfig(tensor_parallel="shard_map")
NEW = 12
TREE = dict(depth=2, width=3, branch=2, bs=6)
COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter")


def placed(m, n: int):
    return sharding.place(m, jax.devices()[:n])[0]


@functools.cache
def models():
    """A target, a draft that agrees partly, prompts and the target's greedy tokens."""
    target = tiny.model(0, **tiny.TP)
    ps = tiny.prompts(0, vocab=tiny.TP["vocab_size"])
    ref = generate(target, ps, max_new_tokens=NEW).tokens
    return target, tiny.perturbed(target, 0.3, 1), ps, ref


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "method, n",
    [("autoregressive", 2)]
    + [pytest.param(m, n, marks=SLOW) for m in ("autoregressive", "chain", "tree") for n in
       (1, 2, 4) if (m, n) != ("autoregressive", 2)],
)  # fmt: skip
def test_shard_map_step_is_greedy_equal_to_one_device(method, n):
    target, draft, ps, ref = models()
    pt = placed(target, n)
    assert (pt.net(TP).tp is None) == (n == 1)  # one device: nothing to split
    kw = dict(max_new_tokens=NEW, kernels=TP, method=method)
    if method != "autoregressive":
        kw.update(draft=placed(draft, n), **(dict(gamma=3) if method == "chain" else TREE))
    assert generate(pt, ps, **kw).tokens == ref


def test_shard_map_step_with_a_draft_whose_head_is_cut_is_greedy_equal():
    """A draft head over a subset of the vocabulary (``model.vocab_head``) is replicated: each
    device returns its slice of the whole-vocabulary logits."""
    target, draft, ps, ref = models()
    cut = with_vocab(draft, np.arange(0, tiny.TP["vocab_size"], 3))
    got = generate(placed(target, 2), ps, draft=placed(cut, 2), method="chain", gamma=3,
                   max_new_tokens=NEW, kernels=TP)  # fmt: skip
    assert got.tokens == ref


@SLOW
def test_shard_map_step_with_a_self_draft_on_the_same_mesh_is_greedy_equal():
    target, _, ps, ref = models()
    r = generate(placed(target, 2), ps, draft="self-streaming", method="tree", max_new_tokens=NEW,
                 kernels=TP, budget=20, sinks=4, **TREE)  # fmt: skip
    assert r.tokens == ref


@SLOW
@pytest.mark.parametrize(
    "kernels",
    [
        KernelConfig(tensor_parallel="shard_map", all_reduce="oneshot_reference"),
        # every reduction the one-shot kernel of remote DMAs, through Pallas' interpreter
        KernelConfig(tensor_parallel="shard_map", all_reduce="interpret"),
        # each device's heads through the fused RoPE + attention kernel (its head_dim: 64)
        KernelConfig(tensor_parallel="shard_map", fused_attention="interpret"),
    ],
    ids=["oneshot_reference", "interpret", "fused_attention"],
)
def test_shard_map_step_with_other_reductions_and_kernels_is_greedy_equal(kernels):
    cfg = dict(tiny.TP, num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=64)
    target = tiny.model(1, **cfg)
    ps = tiny.prompts(1, vocab=cfg["vocab_size"])
    ref = generate(target, ps, max_new_tokens=6).tokens
    pt = placed(target, 2)
    if kernels.fused_attention == "interpret":  # kept on the split weights
        assert pt.net(kernels).kernels.fused_attention == "interpret"
    assert generate(pt, ps, max_new_tokens=6, kernels=kernels).tokens == ref


@SLOW
@pytest.mark.parametrize("bits, group", [(8, None), (4, 16)], ids=["int8", "int4"])
def test_shard_map_step_of_a_quantized_target_is_greedy_equal_to_one_device(bits, group):
    """Codes, scales (and the vocabulary-split quantized embedding, stored [D, V]) go through the
    explicit step as they lie: its tokens are the quantized target's own on one device."""
    target = Q.quantize_model(
        tiny.model(4, num_heads=4, num_kv_heads=4, vocab_size=64), bits, group
    )
    ps = tiny.prompts(4, vocab=64)
    ref = generate(target, ps, max_new_tokens=NEW).tokens
    pt = placed(target, 2)
    assert pt.net(TP).tp is not None
    assert generate(pt, ps, max_new_tokens=NEW, kernels=TP).tokens == ref


@SLOW
def test_shard_map_step_feeds_a_feature_draft_the_targets_whole_states():
    """A feature draft reads the target's states (here fused: the first layer's output and the
    final state), which the explicit step returns whole beside its vocabulary-split logits:
    chain output is the target's greedy."""
    target, _, ps, ref = models()
    pt = placed(target, 2)
    head = feature_head.random_head(pt, seed=1, reads=(0, FINAL))
    r = generate(pt, ps, draft=head, gamma=3, max_new_tokens=NEW, kernels=TP, method="chain")
    assert r.tokens == ref


def collectives(compiled_text: str) -> dict[str, int]:
    return {op: len(re.findall(rf"= \S+ {op}(-start)?\(", compiled_text)) for op in COLLECTIVES}


def _request(batch=2, width=16, new=8):
    return base.Request(batch, width, new, Sampling(), ())


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=SLOW)])
def test_decode_program_has_exactly_the_collectives_written(n):
    """The whole autoregressive program (prefill loop + decode loop): each of its two forwards
    has one all-reduce for the embedding and two per layer, and one all-gather of (max, index)
    pairs for its argmax; nothing else (no gathered weights, cache or logits)."""
    target = placed(tiny.model(0, **tiny.TP), n)
    eng = base.ENGINES["autoregressive"]
    req = _request()
    prog, _ = eng.program(target, None, eng.Options(), req, TP)
    ids, lens = np.zeros((2, 16), np.int32), np.array([5, 9], np.int32)
    lowered = jax.jit(autoregressive.decode, static_argnums=0).lower(
        prog, target.flat, None, ids, lens, np.uint32(0)
    )
    layers = target.config.num_layers
    want = dict.fromkeys(COLLECTIVES, 0)
    want.update({"all-reduce": 2 * (1 + 2 * layers), "all-gather": 2})
    assert collectives(lowered.compile().as_text()) == want


@SLOW
def test_tree_verify_and_commit_has_exactly_the_collectives_written():
    """A tree verify of bs + 1 nodes and the commit of its accepted path into the head-split
    cache: the forward's 1 + 2L all-reduces and the argmax's one all-gather. The same step
    through GSPMD gathers more (here: whatever the partitioner chose)."""
    target = placed(tiny.model(0, **tiny.TP), 2)
    req = _request()
    opts = tree.Options(**TREE)
    prog, dw = tree.ENGINE.program(target, target, opts, req, TP)
    ids, lens = np.zeros((2, 16), np.int32), np.array([5, 9], np.int32)
    state = jax.jit(tree.init, static_argnums=0)(prog, target.flat, dw.flat, ids, lens, 0)
    grown = jax.jit(tree.grow, static_argnums=0)(prog, dw.flat, state.draft)

    def verify(prog, flat, s, dstate):
        tb = tree.snapshot(dstate.tree, prog.shape.bs, s.cache.length, s.cache.length)
        return tree.verify_and_commit(prog.net, flat, s.cache, tb, s.key, s.out, Sampling(), ())

    lowered = jax.jit(verify, static_argnums=0).lower(prog, target.flat, state, grown)
    want = dict.fromkeys(COLLECTIVES, 0)
    want.update({"all-reduce": 1 + 2 * target.config.num_layers, "all-gather": 1})
    assert collectives(lowered.compile().as_text()) == want


@SLOW
def test_oneshot_reference_reductions_are_collective_permutes():
    """With all_reduce='oneshot_reference' every reduction is N - 1 collective permutes (the
    one-shot algorithm written in jax.lax) and no all-reduce is left."""
    n = 4
    target = placed(tiny.model(0, **tiny.TP), n)
    kernels = KernelConfig(tensor_parallel="shard_map", all_reduce="oneshot_reference")
    eng = base.ENGINES["autoregressive"]
    prog, _ = eng.program(target, None, eng.Options(), _request(), kernels)
    ids, lens = np.zeros((2, 16), np.int32), np.array([5, 9], np.int32)
    text = (
        jax.jit(autoregressive.decode, static_argnums=0)
        .lower(prog, target.flat, None, ids, lens, np.uint32(0))
        .compile()
        .as_text()
    )
    got = collectives(text)
    reductions = 2 * (1 + 2 * target.config.num_layers)
    assert got["all-reduce"] == 0 and got["all-gather"] == 2
    assert got["collective-permute"] == reductions * (n - 1)


# ---------------------------------------------------------------- the split vocabulary


def _net(n: int) -> Net:
    """A Net whose outputs lie over n devices (the vocabulary functions read only that)."""
    net = tiny.model(0, **tiny.TP).net(TP)
    layout = tensor_parallel.TensorParallel(n, ())
    return Net(net.graphdef, net.cfg, net.kernels, net.treedef, net.dtype, layout)


def _split(x, n: int):
    """``x`` laid out over the vocabulary (last axis) on n devices, as the step returns it."""
    net = _net(n)
    mesh = jax.make_mesh((n,), (sharding.TP,), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,))  # fmt: skip
    return net, jax.device_put(x, NamedSharding(mesh, tensor_parallel.vocab_spec(x.ndim)))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_argmax_over_the_split_vocabulary_is_jnp_argmax_ties_included(n):
    rng = np.random.RandomState(n)
    # small integers: many exact ties, also across devices (jnp.argmax takes the first)
    logits = rng.randint(-3, 4, size=(5, 3, 72)).astype(np.float32)
    net, split = _split(logits, n)
    got = jax.jit(lambda x: tensor_parallel.argmax(net, x))(split)
    np.testing.assert_array_equal(got, np.argmax(logits, -1))


@pytest.mark.parametrize("n", [2, 4])
def test_top_log_probs_over_the_split_vocabulary(n):
    rng = np.random.RandomState(n)
    logits = rng.randn(4, 2, 72).astype(np.float32) * 3
    net, split = _split(logits, n)
    tok, lp = jax.jit(lambda x: tensor_parallel.top_log_probs(net, x, 4))(split)
    want_lp, want_tok = jax.lax.top_k(jax.nn.log_softmax(logits, -1), 4)
    np.testing.assert_array_equal(tok, want_tok)
    np.testing.assert_allclose(lp, want_lp, rtol=1e-6, atol=1e-6)
    ties = np.round(logits)  # ties: lowest index first, as lax.top_k
    tok, _ = jax.jit(lambda x: tensor_parallel.top_log_probs(net, x, 4))(_split(ties, n)[1])
    np.testing.assert_array_equal(tok, jax.lax.top_k(jnp.asarray(ties), 4)[1])


def test_gather_returns_the_whole_logits():
    logits = np.random.RandomState(0).randn(3, 72).astype(np.float32)
    net, split = _split(logits, 4)
    np.testing.assert_array_equal(jax.jit(lambda x: tensor_parallel.gather(net, x))(split), logits)


def test_gumbel_sampling_over_split_vocabulary_is_gumbel_max_with_the_shared_key():
    """Each device adds the Gumbel noise of its own slice: the draw is exactly argmax(l / T + G)
    with G drawn for the whole vocabulary from the shared key (layout-independent), and its
    frequencies match softmax(l / T) (chi-square), where the wrong temperature fails."""
    rows, v, t = 4000, 72, 0.7
    logits = np.random.RandomState(1).randn(v).astype(np.float32)
    batch = np.broadcast_to(logits, (rows, v)).copy()
    key = jax.random.key(3)
    for n in (2, 4):
        net, split = _split(batch, n)
        draw = jax.jit(functools.partial(tensor_parallel.gumbel_argmax, net, key, temperature=t))
        got = np.asarray(draw(split))
        noise = jax.random.gumbel(key, (rows, v), jnp.float32)
        np.testing.assert_array_equal(got, np.argmax(batch / t + np.asarray(noise), -1))
    counts = np.bincount(got, minlength=v)

    def chi2(temperature):
        p = np.asarray(jax.nn.softmax(logits / temperature))
        keep = p * rows >= 5
        expected = p[keep] * rows
        return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1

    stat, dof = chi2(t)
    assert stat < dof + 6 * np.sqrt(2 * dof)  # ~6 sigma of the chi-square's spread
    bad, dof = chi2(1.5 * t)
    assert bad > dof + 6 * np.sqrt(2 * dof)  # the negative control


@SLOW
def test_sampled_tokens_do_not_depend_on_the_tensor_parallel_degree():
    """Temperature sampling draws its Gumbel noise for the whole vocabulary from the shared key,
    so 2 and 4 devices draw the same tokens (their logits agree to rounding); top-p ranks the
    gathered vocabulary and also runs."""
    target = tiny.model(2, **tiny.TP)
    ps = tiny.prompts(2, vocab=tiny.TP["vocab_size"])
    kw = dict(max_new_tokens=NEW, kernels=TP, temperature=0.8, seed=5)
    two, four = (generate(placed(target, n), ps, **kw).tokens for n in (2, 4))
    assert two == four
    r = generate(placed(target, 2), ps, top_p=0.9, **kw)
    assert all(len(t) == NEW for t in r.tokens)


def test_kernel_config_names_the_tensor_parallel_choices():
    with pytest.raises(OptionError, match="tensor_parallel"):
        KernelConfig(tensor_parallel="megatron")
    with pytest.raises(OptionError, match="all_reduce"):
        KernelConfig(all_reduce="ring")
    with pytest.raises(OptionError, match="oneshot_reference"):
        KernelConfig(all_reduce="oneshot").resolve(tiny.CFG, backend="cpu")
    auto = KernelConfig().resolve(tiny.CFG, backend="gpu")
    assert (auto.tensor_parallel, auto.all_reduce) == ("gspmd", "psum")  # until measured
    env = {"JAXSPEC_TENSOR_PARALLEL": "shard_map", "JAXSPEC_ALL_REDUCE": "oneshot"}
    k = KernelConfig.from_env(env)
    assert (k.tensor_parallel, k.all_reduce) == ("shard_map", "oneshot")
    # the step runs a device's heads through the fused attention kernel; the projection
    # kernels and the commit kernel stay off on sharded weights
    gpu = KernelConfig(tensor_parallel="shard_map").resolve(tiny.CFG, backend="gpu", sharded=True)
    assert gpu.fused_attention == "pallas" and gpu.fused_linear == gpu.fused_commit == "off"
    # invariant numerics keep the partitioner's exact integer sums
    exact = KernelConfig(tensor_parallel="shard_map", invariant=True).resolve(tiny.CFG)
    assert exact.tensor_parallel == "gspmd"
    # every choice is part of the compiled program's identity (the Net, hence the compile key)
    pt = placed(tiny.model(0, **tiny.TP), 2)
    nets = {pt.net(KernelConfig(tensor_parallel="gspmd"))}
    nets |= {pt.net(KernelConfig(tensor_parallel="shard_map", all_reduce=a)) for a in
             ("psum", "oneshot_reference", "interpret")}  # fmt: skip
    assert len(nets) == 4 and pt.net(TP) in nets
    assert pt.net(TP).tp == tensor_parallel.TensorParallel(2, pt.net(TP).tp.specs)
    assert placed(tiny.model(0, **tiny.TP), 4).net(TP) != pt.net(TP)  # the mesh's degree too
