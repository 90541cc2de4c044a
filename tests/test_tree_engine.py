"""Tree speculation returns exactly the target's greedy tokens, whatever the draft and shape."""

import pytest

from jaxspec.api import generate
from tests import tiny

SEEDS = range(20)
NEW = 24
SHAPE = dict(depth=3, width=3, branch=2, bs=6)


def reference(target, ps):
    return generate(target, ps, max_new_tokens=NEW).tokens


def test_tree_greedy_equals_autoregressive_random_and_partial_drafts():
    for seed in SEEDS:
        target, ps = tiny.model(seed), tiny.prompts(seed)
        ref = reference(target, ps)
        for draft in (tiny.model(500 + seed), tiny.perturbed(target, 0.3, seed)):
            r = generate(target, ps, draft=draft, method="tree", max_new_tokens=NEW, **SHAPE)
            assert r.tokens == ref, seed


@pytest.mark.parametrize("kind", ["ngram", "self-streaming", "self-snapkv"])
def test_tree_greedy_equals_autoregressive_builtin_drafts(kind):
    # budgets below the longest prompts, so the sparse selections really drop tokens
    opts = {
        "ngram": {},
        "self-streaming": {"budget": 20, "sinks": 2},
        "self-snapkv": {"budget": 40},
    }
    opts = opts[kind]
    for seed in SEEDS:
        target, ps = tiny.model(seed), tiny.prompts(seed, lengths=(61, 3, 45))
        r = generate(target, ps, draft=kind, method="tree", max_new_tokens=NEW, **SHAPE, **opts)
        assert r.tokens == reference(target, ps), seed


def test_tree_target_as_own_draft_accepts_the_whole_path():
    for seed in SEEDS:
        target, ps = tiny.model(seed), tiny.prompts(seed)
        r = generate(
            target,
            ps,
            draft=target,
            method="tree",
            max_new_tokens=NEW,
            depth=4,
            width=1,
            branch=1,
            bs=4,
        )
        assert r.tokens == reference(target, ps), seed
        assert r.stats["acceptance_length"] == pytest.approx(5.0), seed


# One EOS id for every seed: the EOS targets then differ only in their weights, so their programs
# compile once (an EOS id of its own per seed compiled two programs a seed). 15 comes first at
# token 5 of seed 0's greedy tokens and at token 6 of seed 2's; seeds 1, 3, 4 never emit it.
EOS = 15


def test_tree_stops_at_eos_inside_an_accepted_path():
    places = set()
    for seed in range(5):
        base, ps = tiny.model(seed), tiny.prompts(seed, lengths=(9,))
        ref = reference(base, ps)[0]
        target = tiny.with_eos(base, EOS)
        expected = ref[: ref.index(EOS) + 1] if EOS in ref else ref
        if EOS in ref:  # token 0 is the prefill's, then paths of 5 (4 drafts + the bonus)
            places.add("end" if ref.index(EOS) % 5 == 0 else "inside")
        r = generate(
            target,
            ps,
            draft=target,
            method="tree",
            max_new_tokens=NEW,
            depth=4,
            width=1,
            branch=1,
            bs=4,
        )
        assert r.tokens[0] == expected, seed
    # the EOS fell inside an accepted path (drafts after it dropped) and at its end (the bonus)
    assert places == {"inside", "end"}, "the models changed: pick another EOS"
