"""jaxspec distill --kind feature: an EAGLE-1 head trained on a tiny target's own text whose loss
falls, which loads as a feature draft, drafts losslessly in every engine that takes it and
better than its random start, resumes exactly, keeps to its budget and refuses another target.
The default run trains once (the module's fixture) and checks the loss, the stored draft, a
lossless chain that beats the random start and the refusals; the other engines, resume, the
budget (a 30-second run) and the CLI are ``slow``."""

import json
import shutil
import time

import jax
import numpy as np
import pytest

from jaxspec import cli
from jaxspec.api import generate
from jaxspec.errors import DraftError, OptionError
from jaxspec.io.draft_checkpoint import load_draft
from jaxspec.model.feature_head import FeatureModel, random_head
from jaxspec.train import distill as D
from tests import tiny

PROMPTS = tiny.prompts(1, lengths=(13, 9, 300, 11))
RUN = dict(
    kind="feature",
    intermediate=32,
    seq_len=32,
    batch=4,
    lr=3e-3,
    warmup=3,
    samples=2,
    max_new=24,
    gen_batch=4,
    progress=False,
)


@pytest.fixture(scope="module")
def target():
    return tiny.model(0)


@pytest.fixture(scope="module")
def run(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("feature") / "run"
    return D.distill(target, out, prompts=PROMPTS, steps=40, save_every=10, **RUN)


def test_loss_falls_and_the_head_is_stored_without_the_target(run, target):
    losses = [h["loss"] for h in run.history]
    assert run.steps == run.total_steps == 40
    assert np.mean(losses[-5:]) < 0.95 * np.mean(losses[:5])
    assert np.mean([h["agree"] for h in run.history[-5:]]) > run.history[0]["agree"]
    meta = json.loads((run.path / "draft.json").read_text())
    assert (meta["kind"], meta["variant"], meta["reads"]) == ("feature", "eagle-1", [-1])
    assert meta["config"]["num_layers"] == 1 and meta["training"]["recipe"]["init"] == "random"
    d, f = 32, 32  # fc [2d, d] + bias, one layer of the target's attention and a 32-unit MLP
    assert meta["parameters"] == 2 * d * d + d + 2 * d + 2 * d * d + 2 * d * 16 + 3 * d * f


@pytest.mark.parametrize(
    "method,opts",
    [
        ("chain", {"gamma": 3}),
        pytest.param("tree", {"depth": 3}, marks=pytest.mark.slow),
        pytest.param("magicdec", {"gamma": 3}, marks=pytest.mark.slow),
    ],
)
def test_the_trained_head_drafts_losslessly_and_beats_its_start(run, target, method, opts):
    head = load_draft(run.path.parent, target)  # the distill folder works too
    assert isinstance(head, FeatureModel) and head.dtype == target.dtype
    pd, pt = jax.tree.leaves(head.params), jax.tree.leaves(target.params)
    assert any(a is b for a in pd for b in pt)  # the embedding is shared, not copied
    want = generate(target, PROMPTS, max_new_tokens=20).tokens
    got = generate(target, PROMPTS, draft=head, method=method, max_new_tokens=20, **opts)
    start = generate(target, PROMPTS, draft=random_head(target, intermediate=32), method=method,
                     max_new_tokens=20, **opts)  # fmt: skip
    assert got.tokens == want and start.tokens == want
    assert got.stats["acceptance_length"] > start.stats["acceptance_length"]


@pytest.mark.slow
def test_resume_gives_the_same_weights(run, target, tmp_path):
    out = tmp_path / "split"
    out.mkdir()
    shutil.copytree(run.path.parent / "data", out / "data")
    first = D.distill(target, out, prompts=PROMPTS, steps=40, save_every=10, until_step=13, **RUN)
    assert first.stopped == "until_step" and first.steps == 13
    again = D.distill(target, out, prompts=PROMPTS, resume=True, save_every=10, progress=False)
    assert again.steps == 40
    assert [h["loss"] for h in first.history + again.history] == [h["loss"] for h in run.history]
    a = jax.tree.leaves(load_draft(again.path, target).params)
    b = jax.tree.leaves(load_draft(run.path, target).params)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    with pytest.raises(OptionError, match="kind="):
        D.distill(target, out, prompts=PROMPTS, resume=True, kind="model", progress=False)


@pytest.mark.slow
def test_the_budget_bounds_the_whole_run(target, tmp_path):
    """A run whose steps would take far longer than its budget stops in time (data, compile,
    steps, the checkpoint and the draft's write all inside it, give or take max(10%, 30 s))."""
    budget = 30.0
    t0 = time.perf_counter()
    r = D.distill(target, tmp_path / "b", prompts=PROMPTS, steps=100_000, budget_s=budget, **RUN)
    took = time.perf_counter() - t0
    assert r.stopped == "budget" and (r.path / "draft.json").is_file()
    assert took <= budget + max(0.1 * budget, 30.0), took


def test_bad_options_and_another_target(run, target, tmp_path):
    with pytest.raises(OptionError, match="kind must be"):
        D.distill(target, tmp_path / "a", prompts=PROMPTS, kind="eagle9", progress=False)
    with pytest.raises(OptionError, match="random weights"):
        D.distill(target, tmp_path / "a", prompts=PROMPTS, kind="feature", init="copy")
    with pytest.raises(OptionError, match="noise"):
        D.distill(target, tmp_path / "a", prompts=PROMPTS, kind="feature", noise=-1.0)
    with pytest.raises(DraftError, match="another target"):
        load_draft(run.path, tiny.model(1))


@pytest.mark.slow
def test_cli_distills_a_feature_draft_and_generates_with_it(tmp_path, capsys):
    """`jaxspec distill --kind feature` on a tiny converted checkpoint, then `generate --draft`
    (method auto -> chain) gives the greedy text."""
    import jaxspec
    from tests import hf_fixtures

    hf_fixtures.save_hf_checkpoint("llama3.1", tmp_path / "hf", tokenizer=True)
    ckpt = jaxspec.convert(tmp_path / "hf", tmp_path / "m", dtype="float32", progress=False)
    prompts = tmp_path / "p.txt"
    prompts.write_text("w3 w4 w5 w6\nw7 w8 w9\nw10 w11 w3 w4 w12\n")
    out = tmp_path / "run"
    argv = ["distill", "--target", str(ckpt), "--out", str(out), "--data", f"file:{prompts}"]
    argv += ["--kind", "feature", "--intermediate", "16", "--seq-len", "16", "--batch", "2"]
    argv += ["--steps", "3", "--samples", "1", "--max-new-tokens", "16", "--gen-batch", "3"]
    assert cli.main(argv) == 0
    assert "3/3 steps" in capsys.readouterr().out
    assert json.loads((out / "draft" / "draft.json").read_text())["kind"] == "feature"
    gen = ["generate", "w3 w4 w5", "--model", str(ckpt), "--raw", "--max-new-tokens", "12"]
    assert cli.main([*gen, "--method", "autoregressive"]) == 0
    want = capsys.readouterr().out
    for method in ("chain", "tree"):
        assert cli.main([*gen, "--draft", str(out), "--method", method]) == 0
        got = capsys.readouterr()
        assert got.out == want and f"[{method}]" in got.err
