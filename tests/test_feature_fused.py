"""Feature heads with fused reads (EAGLE-3's input, ``model.feature_head``): a head widened from
an EAGLE-1 one computes exactly what it did until its ``fuse`` opens; a distill trains one from
a finished EAGLE-1 head, stores its reads, and the loaded head drafts losslessly; bad reads are
refused with what to do. (Greedy equality of fused heads in every engine: the odd seeds of
``test_feature_draft``'s random heads.)"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec import generate, load_draft
from jaxspec.errors import CheckpointError, OptionError
from jaxspec.model.feature_head import (
    SHARED,
    fuse_states,
    head_model,
    parse_reads,
    random_head,
    widened,
)
from jaxspec.model.transformer import FINAL
from jaxspec.train import distill as D
from jaxspec.train.feature import init_head
from jaxspec.train.recipe import Recipe
from tests import tiny
from tests.test_feature_distill import PROMPTS, RUN
from tests.test_feature_ttt import drafted

READS = (0, FINAL)  # the first layer's output beside the final state (the tiny target has 2)
LAST = (1, FINAL)  # the target's last layer: an index past the 1-layer head's own layers


@pytest.fixture(scope="module")
def target():
    return tiny.model(0)


def own_of(head) -> dict:
    return {k: v for k, v in nnx.to_pure_dict(head.params).items() if k not in SHARED}


def test_a_widened_head_computes_what_the_eagle1_head_did(target):
    """``widened``: the EAGLE-1 head's weights with a ``fuse`` that passes the final state
    through give bit for bit its logits and states at every draft step, whatever the other
    layer's state; a ``fuse`` that reads that layer too gives others (the negative control)."""
    small = random_head(target, intermediate=32, seed=5)
    fresh = init_head(target, Recipe(kind="feature", intermediate=32, reads="0,final"))
    wide_own = widened(own_of(small), fresh, READS)
    wide = head_model(target, small.config, wide_own, "widened", READS)
    rng = np.random.RandomState(3)
    b, n, d = 2, 7, target.config.hidden_size
    tokens = jnp.asarray(rng.randint(0, target.config.vocab_size, (b, n)), jnp.int32)
    final = jnp.asarray(rng.normal(size=(b, n, d)), jnp.float32)
    low = jnp.asarray(rng.normal(size=(b, n, d)) * 30, jnp.float32)  # a layer's raw scale
    both = jnp.concatenate([low, final], axis=-1)  # apply's order: the reads' order
    fused = fuse_states(wide.net(), wide.flat, both)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(final))
    for start, steps in ((0, 3), (3, 2)):
        want = drafted(small, tokens, final, start, steps)
        got = drafted(wide, tokens, fused, start, steps)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    opened = dict(wide_own, fuse={"kernel": wide_own["fuse"]["kernel"].at[:d].set(0.1)})
    head = head_model(target, small.config, opened, "opened", READS)
    assert not np.allclose(np.asarray(fuse_states(head.net(), head.flat, both)), final)


def test_a_distill_widens_an_eagle1_head_stores_its_reads_and_drafts_losslessly(target, tmp_path):
    first = D.distill(target, tmp_path / "a", prompts=PROMPTS, steps=12, save_every=50, **RUN)
    run = D.distill(target, tmp_path / "b", prompts=PROMPTS, steps=4, save_every=50,
                    init_from=str(first.path), reads="1,final", **RUN)  # fmt: skip
    assert run.steps == 4 and all(np.isfinite(r["loss"]) for r in run.history)
    # its first step's loss is the EAGLE-1 head's on the same batch (the widened head computes
    # what it did), not a fresh head's
    same = D.distill(target, tmp_path / "s", prompts=PROMPTS, steps=1, save_every=50,
                     init_from=str(first.path), **RUN)  # fmt: skip
    assert run.history[0]["kl"] == pytest.approx(same.history[0]["kl"], rel=1e-5)
    meta = json.loads(run.path.joinpath("draft.json").read_text())
    assert (meta["variant"], meta["reads"]) == ("eagle-3-fused", [1, -1])
    # the head it grew from keeps its record, nested (and that one has none: random weights)
    first_meta = json.loads(first.path.joinpath("draft.json").read_text())
    assert meta["training"]["init_from_training"] == first_meta["training"]
    assert "init_from_training" not in first_meta["training"]
    head = load_draft(run.path, target, vocab=None)
    assert head.reads == LAST and "fuse" in own_of(head)
    assert not np.array_equal(  # training moved the fuse off the final state alone
        np.asarray(own_of(head)["fuse"]["kernel"][: target.config.hidden_size]), 0
    )
    ps = tiny.prompts(1, lengths=(9, 3, 6))
    want = generate(target, ps, max_new_tokens=12).tokens
    for method in ("chain", "tree"):
        assert generate(target, ps, draft=head, method=method, max_new_tokens=12).tokens == want
    # a fused head is not widened again into other reads
    with pytest.raises(OptionError, match="widened from an EAGLE-1"):
        D.distill(target, tmp_path / "c", prompts=PROMPTS, steps=2, init_from=str(run.path),
                  reads="0,final", **RUN)  # fmt: skip


@pytest.mark.parametrize(
    "reads, says",
    [
        ("0,1", "must name 'final' once"),
        ("final,0,final", "must name 'final' once"),
        ("2,final", "neither 'final' nor a layer index"),
        ("low,final", "neither 'final' nor a layer index"),
    ],
)
def test_bad_reads_are_refused(reads, says):
    with pytest.raises(OptionError, match=says):
        parse_reads(reads, 2)


def test_reads_are_refused_where_they_cannot_run(target, tmp_path):
    with pytest.raises(OptionError, match="small draft"):
        D.distill(target, tmp_path / "m", prompts=PROMPTS, steps=2,
                  **{**RUN, "kind": "model", "init": "random", "reads": "0,final"})  # fmt: skip
    with pytest.raises(OptionError, match="layer index"):
        D.distill(target, tmp_path / "f", prompts=PROMPTS, steps=2, reads="5,final", **RUN)


def test_a_draft_json_with_damaged_reads_is_a_checkpoint_error(target, tmp_path):
    run = D.distill(target, tmp_path / "a", prompts=PROMPTS, steps=2, save_every=50,
                    reads="0,final", **RUN)  # fmt: skip
    assert load_draft(run.path, target, vocab=None).reads == READS
    path = run.path / "draft.json"
    meta = json.loads(path.read_text())
    for bad in ([0], [7, -1], "final"):
        path.write_text(json.dumps({**meta, "reads": bad}))
        with pytest.raises(CheckpointError, match="names reads"):
            load_draft(run.path, target, vocab=None)


def test_a_start_draft_with_a_damaged_record_is_a_checkpoint_error(tmp_path):
    """``init_from``'s training record is read when the run begins: a draft.json that is not
    JSON, or no draft at all, is a CheckpointError that says what to do, not a traceback."""
    from jaxspec.train.init_from import training_of

    (tmp_path / "draft.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="distil it again"):
        training_of(str(tmp_path))
    with pytest.raises(CheckpointError, match="no distilled draft"):
        training_of(str(tmp_path / "absent"))
    (tmp_path / "draft.json").write_text('{"training": {"steps": 3}}')
    assert training_of(str(tmp_path)) == {"steps": 3}
