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


def test_chain_stops_at_eos_inside_a_speculated_block():
    for seed in range(5):
        base, ps = tiny.model(seed), tiny.prompts(seed, lengths=(9,))
        ref = reference(base, ps)[0]
        eos = ref[6]
        target = tiny.with_eos(base, eos)
        expected = ref[: ref.index(eos) + 1]
        r = generate(target, ps, draft=target, method="chain", gamma=5, max_new_tokens=NEW)
        assert r.tokens[0] == expected
        assert reference(target, ps)[0] == expected
