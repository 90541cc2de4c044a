"""MagicDec with batched trees: per-row greedy equality with autoregressive decoding (float32,
ragged batches up to 8, prompts shorter and longer than the budget, EOS at different steps, each
draft kind), full acceptance when the sparse draft is exact, the tree term of the cost model and
``shape="auto"``."""

import dataclasses

import pytest

from jaxspec.api import generate
from jaxspec.engines import magicdec
from jaxspec.errors import OptionError
from jaxspec.measure import cost_model
from tests import tiny
from tests.test_magicdec import BUDGET, KINDS, LENS8, NEW, eos_target, reference

TREE = dict(depth=2, width=2, branch=2, bs=4)


# two kinds (one self, one small model; one SnapKV, one StreamingLLM) run by default, all four
# with -m slow
DEFAULT_KINDS = ("self-snapkv", "model-streaming")


@pytest.mark.parametrize(
    "kind",
    [k if k in DEFAULT_KINDS else pytest.param(k, marks=pytest.mark.slow) for k in KINDS],
)
def test_magicdec_tree_greedy_equals_autoregressive_ragged_eos(kind):
    ps = tiny.prompts(2, lengths=LENS8)
    target = eos_target(2, ps)
    ref = reference(target, ps)
    ends = sorted(len(r) for r in ref)
    assert ends[0] < ends[-2] < NEW or ends[0] < ends[1] < NEW  # EOS at different steps
    draft, opts = KINDS[kind](target)
    r = generate(
        target,
        ps,
        draft=draft,
        method="magicdec",
        shape="tree",
        max_new_tokens=NEW,
        budget=BUDGET,
        **TREE,
        **opts,
    )
    assert r.tokens == ref
    assert r.stats["shape"] == "tree" and r.stats["gamma"] is None
    assert r.stats["tree"]["depth"] == 2 and r.stats["budget"] == BUDGET
    assert 1.0 < r.stats["acceptance_length"] <= 3.0


@pytest.mark.parametrize(
    "lengths, kind, opts",
    [
        pytest.param((50,), "self-snapkv", dict(obs=4), marks=pytest.mark.slow),
        ((3, 41, 26, 11), "self-streaming", dict(sinks=3)),
    ],
)
def test_magicdec_tree_batch_sizes(lengths, kind, opts):
    for seed in range(3):
        target, ps = tiny.model(seed), tiny.prompts(seed, lengths=lengths)
        r = generate(
            target, ps, draft=kind, method="magicdec", max_new_tokens=NEW, budget=BUDGET,
            **TREE, **opts,
        )  # fmt: skip
        assert r.stats["shape"] == "tree"  # a tree option picks the shape
        assert r.tokens == reference(target, ps), seed


@pytest.mark.parametrize(
    "draft", ["self-snapkv", pytest.param("self-streaming", marks=pytest.mark.slow)]
)
def test_magicdec_tree_exact_sparse_draft_accepts_whole_paths(draft):
    """With a budget that holds every token the sparse draft is the target itself: each verify
    accepts the whole path (depth) plus the bonus token, whatever the batch raggedness."""
    target, ps = tiny.model(3, num_layers=1), tiny.prompts(3, lengths=(20, 7, 33))
    r = generate(
        target, ps, draft=draft, method="magicdec", max_new_tokens=NEW, budget=128,
        shape="tree", depth=4, width=1, branch=1, bs=4,
    )  # fmt: skip
    assert r.tokens == reference(target, ps)
    assert r.stats["acceptance_length"] == pytest.approx(5.0)


def test_tree_cost_model_hand_numbers():
    # T_T = 10, T_E = 2, T_V(bs) = 14, depth 3, L = 3.2: (6 + 14) / (10 * 3.2) = 0.625
    assert cost_model.tree_relative_time(3, 2.0, 10.0, 14.0, 3.2) == pytest.approx(0.625)
    chain = cost_model.Measurement(1, 64, 10.0, 1.0, {3: 13.0}, 0.8, 3, 2.952)
    # chain: gamma 3 at 1 / (1.6 / 2.952) = 1.845
    slow = cost_model.TreeMeasurement(3, 4, 2, 8, 2.0, 14.0, 3.2)  # 1 / 0.625 = 1.6
    assert cost_model.choose_shape(chain, slow) == ("chain", 3, pytest.approx(2.952 / 1.6))
    fast = cost_model.TreeMeasurement(3, 4, 2, 8, 1.0, 12.0, 4.0)  # 40 / 15 = 2.667
    assert cost_model.choose_shape(chain, fast) == ("tree", None, pytest.approx(40 / 15))
    assert cost_model.choose_shape(chain) == ("chain", 3, pytest.approx(2.952 / 1.6))
    no_t_t = dataclasses.replace(chain, t_t=None)  # the same choices, no speedup to report
    assert cost_model.choose_shape(no_t_t, slow) == ("chain", 3, None)
    assert cost_model.choose_shape(no_t_t, fast) == ("tree", None, None)


def test_magicdec_auto_shape(monkeypatch):
    monkeypatch.setattr(magicdec, "GAMMAS", (2,))
    target, ps = tiny.model(6, num_layers=1), tiny.prompts(6, lengths=(30, 12))
    new = 32  # the measurements' own run length: the final run reuses their compiled loop
    r = generate(
        target, ps, draft="self-streaming", method="magicdec", max_new_tokens=new, budget=BUDGET,
        sinks=2, depth=1, width=1, branch=2, bs=2, shape="auto",
    )  # fmt: skip
    assert r.tokens == generate(target, ps, max_new_tokens=new).tokens
    cm = r.stats["cost_model"]
    assert cm["tree"]["t_e_ms"] > 0 and cm["tree"]["t_v_ms"] > 0
    assert 1.0 <= cm["tree"]["acceptance_length"] <= 2.0
    assert cm["alpha_slowest_row"] <= cm["alpha"]
    # a CPU leaves T_T out: both shapes compare by their milliseconds a token, no speedup
    assert cm["t_t_ms"] is None and r.stats["predicted_speedup"] is None
    a, t_d, t_v = cm["alpha_slowest_row"], cm["t_d_ms"], cm["t_v_ms"]  # the slowest row's alpha
    chain_gamma, _ = cost_model.choose_gamma(t_d, 1.0, t_v, a)
    chain_ms = cost_model.relative_time(chain_gamma, a, t_d, 1.0, t_v[chain_gamma])
    if cm["tree"]["token_ms"] < chain_ms:
        assert r.stats["shape"] == "tree" and r.stats["gamma"] is None
    else:  # the measuring call keeps the gamma its loop was compiled at (the alpha run's)
        assert r.stats["shape"] == "chain" and cm["best_gamma"] == chain_gamma
        assert r.stats["gamma"] in (cm["alpha_gamma"], chain_gamma)  # unless the best repays it


def test_magicdec_tree_user_errors():
    target, ps = tiny.model(0), tiny.prompts(0)
    run = dict(draft="self-streaming", method="magicdec", max_new_tokens=4, budget=BUDGET)
    with pytest.raises(OptionError, match="shape must be"):
        generate(target, ps, shape="forest", **run)
    with pytest.raises(OptionError, match="shape='tree'"):
        generate(target, ps, shape="chain", depth=3, **run)
    with pytest.raises(OptionError, match="gamma is the length of a chain"):
        generate(target, ps, shape="tree", gamma=3, **run)
    with pytest.raises(OptionError, match="depth"):
        generate(target, ps, shape="tree", depth=30, **run)
    with pytest.raises(OptionError, match="positive integer"):
        generate(target, ps, shape="tree", width=0, **run)
