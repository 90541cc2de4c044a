"""Chain speculation returns exactly the target's greedy tokens, whatever the draft."""

import pytest

from jaxspec.api import generate
from tests import tiny

SEEDS = range(20)
NEW = 24


def reference(target, ps):
    return generate(target, ps, max_new_tokens=NEW).tokens


@pytest.mark.parametrize("gamma", [1, 4])
def test_chain_greedy_equals_autoregressive_random_drafts(gamma):
    for seed in SEEDS:
        target, draft, ps = tiny.model(seed), tiny.model(1000 + seed), tiny.prompts(seed)
        r = generate(target, ps, draft=draft, method="chain", gamma=gamma, max_new_tokens=NEW)
        assert r.tokens == reference(target, ps), seed


def test_chain_target_as_own_draft_accepts_everything():
    for seed in SEEDS:
        target, ps = tiny.model(seed), tiny.prompts(seed)
        r = generate(target, ps, draft=target, method="chain", gamma=5, max_new_tokens=NEW)
        assert r.tokens == reference(target, ps), seed
        assert r.stats["acceptance_length"] == pytest.approx(6.0), seed


def test_chain_greedy_equals_autoregressive_partial_drafts():
    accs = []
    for seed in SEEDS:
        target, ps = tiny.model(seed), tiny.prompts(seed)
        draft = tiny.perturbed(target, 0.3, seed)
        r = generate(target, ps, draft=draft, method="chain", gamma=3, max_new_tokens=NEW)
        assert r.tokens == reference(target, ps), seed
        accs.append(r.stats["acceptance_length"])
    assert 1.0 < min(accs) and max(accs) < 4.0  # neither zero nor full acceptance


@pytest.mark.parametrize("kind", ["ngram", "self-streaming"])
def test_chain_greedy_equals_autoregressive_builtin_drafts(kind):
    opts = {"budget": 20, "sinks": 2} if kind == "self-streaming" else {}
    for seed in SEEDS:
        target, ps = tiny.model(seed), tiny.prompts(seed, lengths=(29, 3, 11))
        r = generate(target, ps, draft=kind, method="chain", gamma=3, max_new_tokens=NEW, **opts)
        assert r.tokens == reference(target, ps), seed


# One EOS id for every seed: the EOS targets then differ only in their weights, so their programs
# compile once (an EOS id of its own per seed compiled two programs a seed). 15 comes first at
# token 5 of seed 0's greedy tokens and at token 6 of seed 2's; seeds 1, 3, 4 never emit it.
EOS = 15


def test_chain_stops_at_eos_inside_a_speculated_block():
    places = set()
    for seed in range(5):
        base, ps = tiny.model(seed), tiny.prompts(seed, lengths=(9,))
        ref = reference(base, ps)[0]
        target = tiny.with_eos(base, EOS)
        expected = ref[: ref.index(EOS) + 1] if EOS in ref else ref
        r = generate(target, ps, draft=target, method="chain", gamma=5, max_new_tokens=NEW)
        assert r.tokens[0] == expected, seed
        assert reference(target, ps)[0] == expected, seed
        if EOS in ref:  # token 0 is the prefill's, then blocks of 6 (5 drafts + the bonus)
            places.add("end" if ref.index(EOS) % 6 == 0 else "inside")
    # the EOS fell inside a block (drafts after it dropped) and at its end (the bonus token)
    assert places == {"inside", "end"}, "the models changed: pick another EOS"
