"""jaxspec distill: a short run on a tiny target whose loss falls, whose draft loads and drafts
losslessly, resumes exactly, refuses another target, and whose CLI errors exit 2."""

import dataclasses
import json
import re
import shutil
import time

import jax
import numpy as np
import pytest

from jaxspec import cli
from jaxspec.api import generate
from jaxspec.errors import DraftError, JaxspecError, OptionError
from jaxspec.io import draft_checkpoint as DC
from jaxspec.io.draft_checkpoint import load_draft
from jaxspec.train import distill as D
from jaxspec.train import recipe as R
from tests import tiny

# one prompt longer than a prefill chunk (256): the data's prefill must see all of it
PROMPTS = tiny.prompts(1, lengths=(13, 9, 300, 11))
# a 1-layer draft with a trimmed MLP for the 2-layer tiny target
RUN = dict(
    layers=1,
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
    out = tmp_path_factory.mktemp("distill") / "run"
    return D.distill(target, out, prompts=PROMPTS, steps=40, save_every=10, **RUN)


def test_loss_falls_and_the_target_wrote_the_data(run, target):
    losses = [h["loss"] for h in run.history]
    assert run.steps == run.total_steps == 40 and len(losses) == 40
    assert np.mean(losses[-5:]) < 0.95 * np.mean(losses[:5])
    agree = [h["agree"] for h in run.history]
    assert np.mean(agree[-5:]) > np.mean(agree[:5])
    # every document is a prompt followed by the target's own continuation
    stream = np.load(run.path.parent / "data" / "tokens.npy")
    offsets = np.load(run.path.parent / "data" / "offsets.npy")
    meta = json.loads((run.path.parent / "data" / "meta.json").read_text())
    assert meta["documents"] == len(PROMPTS) * 3 and stream.size == offsets[-1]
    greedy = generate(target, PROMPTS, max_new_tokens=24).tokens
    for i, p in enumerate(PROMPTS):  # pass 0 is greedy: exactly the target's greedy tokens
        doc = stream[offsets[i] : offsets[i + 1]].tolist()
        assert doc == p + greedy[i]


def test_draft_loads_small_and_drafts_losslessly(run, target):
    meta = json.loads((run.path / "draft.json").read_text())
    assert meta["config"]["num_layers"] == 1 and meta["config"]["intermediate_size"] == 32
    assert meta["dtype"] == "bfloat16"
    # the shared embedding and head are not stored
    stored = meta["parameters"]
    own = 2 * 32 + 32 + (32 * 32 * 2 + 32 * 16 * 2) + 3 * 32 * 32
    assert stored == own
    draft = load_draft(run.path.parent, target)  # the distill folder works too
    assert draft.config.num_layers == 1 and draft.dtype == target.dtype
    pd, pt = jax.tree.leaves(draft.params), jax.tree.leaves(target.params)
    assert any(a is b for a in pd for b in pt)  # shared, not copied
    want = generate(target, PROMPTS, max_new_tokens=20).tokens
    got = generate(target, PROMPTS, draft=draft, method="chain", max_new_tokens=20, gamma=3)
    assert got.tokens == want
    assert got.stats["acceptance_length"] > 1.0


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,opts",
    [
        ("tree", {"depth": 3}),
        ("magicdec", {"gamma": 3, "sparse": "dense"}),
        ("swiftspec", {"target_devices": 1, "draft_devices": 1, "depth": 2}),
    ],
)
def test_draft_serves_every_engine(run, target, method, opts):
    draft = load_draft(run.path, target)
    want = generate(target, PROMPTS, max_new_tokens=16).tokens
    got = generate(target, PROMPTS, draft=draft, method=method, max_new_tokens=16, **opts)
    assert got.tokens == want


def test_trained_draft_beats_its_init(run, target):
    """The trained draft agrees with the target more often than the copied-layer init."""
    init = DC._draft_model(
        target,
        DC.draft_config(target.config, 1, 32),
        R.init_draft(target, R.Recipe(layers=1, intermediate=32)),
        "init",
    )
    trained = load_draft(run.path, target)
    toks = np.load(run.path.parent / "data" / "tokens.npy")[:64][None]
    best = np.argmax(np.asarray(target.logits(toks)), -1)
    agree = lambda m: float(np.mean(np.argmax(np.asarray(m.logits(toks)), -1) == best))  # noqa: E731
    assert agree(trained) > agree(init)


def test_the_draft_trains_through_differentiable_kernels(target):
    """Training takes gradients through the draft's forward: its kernels resolve to the jnp
    attention and the plain projections on every backend (the Pallas kernels have no
    gradient), whatever the models run with otherwise."""
    for backend in ("cpu", "gpu"):
        k = R.TRAIN_KERNELS.resolve(target.config, backend=backend)
        assert k.attention == "reference"
        assert (k.fused_attention, k.fused_linear, k.fused_commit) == ("off", "off", "off")


def test_resume_gives_the_same_weights(run, target, tmp_path):
    """Stopped at step 17 (checkpoints at 10 and 17), resumed to 40: the same losses and the
    same weights as the uninterrupted 40-step run of the fixture."""
    out = tmp_path / "split"
    out.mkdir()
    shutil.copytree(run.path.parent / "data", out / "data")  # the same data, not regenerated
    first = D.distill(target, out, prompts=PROMPTS, steps=40, save_every=10, until_step=17, **RUN)
    assert first.stopped == "until_step" and first.steps == 17
    assert not (out / "draft").exists()
    again = D.distill(target, out, prompts=PROMPTS, resume=True, save_every=10, progress=False)
    assert again.steps == 40 and [h["step"] for h in again.history] == list(range(18, 41))
    assert [h["loss"] for h in first.history + again.history] == [h["loss"] for h in run.history]
    a = jax.tree.leaves(load_draft(again.path, target).params)
    b = jax.tree.leaves(load_draft(run.path, target).params)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    with pytest.raises(OptionError, match="lr="):
        D.distill(target, out, prompts=PROMPTS, resume=True, lr=1e-2, progress=False)
    with pytest.raises(OptionError, match="already holds"):
        D.distill(target, out, prompts=PROMPTS, **RUN)


def test_another_target_is_a_draft_error(run, target):
    other = tiny.model(1)
    with pytest.raises(DraftError, match="another target"):
        load_draft(run.path, other)
    # the same weights in another dtype are the same target
    import jax.numpy as jnp

    half = tiny.model(0)
    half = type(half)(
        half.config,
        half.graphdef,
        jax.tree.map(lambda x: x.astype(jnp.bfloat16), half.params),
        None,
        "bf16",
    )
    assert load_draft(run.path, half).dtype == jnp.bfloat16


def test_bad_input_is_a_jaxspec_error(target, tmp_path):
    with pytest.raises(OptionError, match="layers"):
        D.distill(target, tmp_path / "a", prompts=PROMPTS, layers=0, progress=False)
    with pytest.raises(OptionError, match="does not take"):
        D.distill(target, tmp_path / "a", prompts=PROMPTS, bogus=1, progress=False)
    with pytest.raises(OptionError, match="fewer than one batch"):
        D.distill(target, tmp_path / "b", prompts=PROMPTS, **{**RUN, "batch": 64})
    assert not (tmp_path / "b" / "draft").exists()
    with pytest.raises(JaxspecError, match="no distilled draft"):
        load_draft(tmp_path / "nothing", target)
    with pytest.raises(JaxspecError, match="nothing to resume"):
        D.distill(target, tmp_path / "c", prompts=PROMPTS, resume=True, progress=False)


def test_corrupt_draft_is_a_checkpoint_error(run, target, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(run.path, bad)
    for f in (bad / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 100:
            f.write_bytes(b"\0" * 16)
    with pytest.raises(JaxspecError, match="corrupt"):
        load_draft(bad, target)


def test_the_draft_keeps_its_datas_token_counts_and_loads_with_a_cut_head(run, target, tmp_path):
    """``token_counts.npy`` counts the distill data's tokens; ``load_draft(vocab=K)`` cuts the
    head to the K most frequent (``model.vocab_head``); without counts only an explicit K is an
    error; bad counts and a bad ``vocab`` are clear errors; ``write_token_counts`` gives an older
    draft its counts."""
    from jaxspec.errors import CheckpointError
    from jaxspec.model.vocab_head import frequent_ids, vocab_size_of

    stream = np.load(run.path.parent / "data" / "tokens.npy")
    counts = np.load(run.path / DC.TOKEN_COUNTS)
    np.testing.assert_array_equal(counts, np.bincount(stream, minlength=tiny.CFG.vocab_size))
    meta = json.loads((run.path / "draft.json").read_text())
    assert meta["token_counts"]["tokens"] == stream.size
    cut = load_draft(run.path, target, vocab=16)
    head = np.asarray(cut.params["vocab_head"]["ids"][...])
    np.testing.assert_array_equal(
        head, frequent_ids(counts, 16, always=target.config.eos_token_ids)
    )
    assert vocab_size_of(load_draft(run.path, target)) is None  # the default > this vocabulary
    assert vocab_size_of(load_draft(run.path, target, vocab=None)) is None
    want = generate(target, PROMPTS, max_new_tokens=12).tokens
    assert (
        generate(target, PROMPTS, draft=cut, method="chain", gamma=3, max_new_tokens=12).tokens
        == want
    )
    old = tmp_path / "old"
    shutil.copytree(run.path, old)
    (old / DC.TOKEN_COUNTS).unlink()
    assert vocab_size_of(load_draft(old, target)) is None
    with pytest.raises(CheckpointError, match="no token_counts.npy"):
        load_draft(old, target, vocab=16)
    with pytest.raises(OptionError, match="vocab="):
        load_draft(run.path, target, vocab="half")
    DC.write_token_counts(old, counts, "test")
    np.testing.assert_array_equal(np.load(old / DC.TOKEN_COUNTS), counts)
    with pytest.raises(OptionError, match="one for each token id"):
        DC.write_token_counts(old, counts[:10], "test")
    assert json.loads((old / "draft.json").read_text())["token_counts"]["source"] == "test"
    (old / DC.TOKEN_COUNTS).write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_draft(old, target, vocab=16)
    np.save(old / DC.TOKEN_COUNTS, counts[:10])
    with pytest.raises(CheckpointError, match="one count for each"):
        load_draft(old, target, vocab=16)


def test_cli_errors_exit_2(tmp_path, capsys):
    assert cli.main(["distill", "--target", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err
    code = cli.main(
        ["distill", "--target", str(tmp_path / "none"), "--out", str(tmp_path), "--layers", "0"]
    )
    assert code == 2


@pytest.mark.slow
def test_cli_distills_and_generates_with_the_draft(tmp_path, capsys):
    """The whole CLI path on a tiny converted checkpoint with a tokenizer: prompts from a
    file, a few steps, then `generate --draft OUT` (method auto -> chain) equals greedy."""
    import jaxspec
    from tests import hf_fixtures

    hf_fixtures.save_hf_checkpoint("llama3.1", tmp_path / "hf", tokenizer=True)
    ckpt = jaxspec.convert(tmp_path / "hf", tmp_path / "m", dtype="float32", progress=False)
    prompts = tmp_path / "p.txt"
    prompts.write_text("w3 w4 w5 w6\nw7 w8 w9\nw10 w11 w3 w4 w12\n")
    out = tmp_path / "run"
    argv = ["distill", "--target", str(ckpt), "--out", str(out), "--data", f"file:{prompts}"]
    argv += ["--layers", "1", "--intermediate", "16", "--seq-len", "16", "--batch", "2"]
    argv += ["--steps", "3", "--samples", "1", "--max-new-tokens", "16", "--gen-batch", "3"]
    assert cli.main(argv) == 0
    said = capsys.readouterr()
    assert "3/3 steps" in said.out
    # fewer steps than a warmup: written, and the command says so with the measured acceptance
    assert "warning: only 3 training steps" in said.err, said.err
    assert re.search(r"Measured acceptance: \d+\.\d\d tokens per verification", said.err)
    meta = json.loads((out / "data" / "meta.json").read_text())
    assert meta["documents"] == 6 and meta["sources"][f"file:{prompts}"]["held_out"] == 0
    gen = ["generate", "w3 w4 w5", "--model", str(ckpt), "--raw", "--max-new-tokens", "12"]
    assert cli.main([*gen, "--method", "autoregressive"]) == 0
    want = capsys.readouterr().out
    assert cli.main([*gen, "--draft", str(out)]) == 0
    got = capsys.readouterr()
    assert got.out == want and "[chain]" in got.err
    # resuming a finished run with another recipe value is refused, exit 2
    assert cli.main([*argv[:5], "--resume", "--lr", "0.5"]) == 2
    assert "lr=" in capsys.readouterr().err


def test_a_failed_write_leaves_no_draft(run, target, tmp_path, monkeypatch):
    out = tmp_path / "fail"
    out.mkdir()
    shutil.copytree(run.path.parent / "data", out / "data")

    def boom(tmp, dst):
        raise OSError("disk full")

    import jaxspec.io.draft_checkpoint as ckpt

    monkeypatch.setattr(ckpt, "_replace", boom)  # the draft's atomic rename
    with pytest.raises(OSError, match="disk full"):
        D.distill(target, out, prompts=PROMPTS, steps=2, **RUN)
    assert not (out / "draft").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".draft")]


def test_the_shipped_draft_is_refused_by_another_target(target):
    """``--method auto`` falls back to autoregressive for a model the shipped draft is not for."""
    assert DC.is_draft_checkpoint(DC.SHIPPED)
    assert DC.shipped_draft(target) is None
    with pytest.raises(DraftError, match="another target"):
        load_draft(DC.SHIPPED, target)


@pytest.mark.slow
def test_the_shipped_draft_drafts_for_smollm2():
    """The shipped draft with the real SmolLM2-135M-Instruct (float32): it loads, chain output
    equals greedy decoding, and it accepts more than one token per verification."""
    import jaxspec
    from jaxspec.io.datasets import humaneval
    from jaxspec.io.default_model import default_checkpoint

    target = jaxspec.load(default_checkpoint(), dtype="float32")
    draft = DC.shipped_draft(target)
    assert draft is not None and draft.config.num_layers == 2
    prompts = humaneval(3)
    want = generate(target, prompts, max_new_tokens=32).tokens
    got = generate(target, prompts, draft=draft, method="chain", max_new_tokens=32, gamma=4)
    assert got.tokens == want
    assert got.stats["acceptance_length"] > 1.2


@pytest.mark.slow
def test_the_budget_bounds_the_whole_run(target, tmp_path):
    """--budget-s 60 once ran 444 s (a whole 64-row data batch, then one more step, before the
    clock was read): a run whose steps would take far longer than its budget now stops in time,
    data, compile, steps and the draft's write inside it, give or take max(10%, 30 s); the draft
    it stopped with is written whole."""
    budget = 30.0
    t0 = time.perf_counter()
    r = D.distill(target, tmp_path / "b", prompts=PROMPTS, steps=100_000, budget_s=budget, **RUN)
    took = time.perf_counter() - t0
    assert r.stopped == "budget" and (r.path / "draft.json").is_file()
    assert took <= budget + max(0.1 * budget, 30.0), took
    load_draft(r.path, target)  # written whole, however brief


def test_a_run_shorter_than_a_warmup_is_too_brief(run):
    assert not run.too_brief and run.steps >= D.BRIEF_STEPS
    assert dataclasses.replace(run, steps=D.BRIEF_STEPS - 1).too_brief


def test_the_token_counts_weigh_each_data_source_equally(tmp_path):
    """``source_counts``: a big source does not crowd a small one out of a cut head. Two passes
    over three prompts (source a: prompts 0-1, source b: prompt 2); a's documents hold 9 tokens
    of id 1, b's 3 of id 2 and 1 of id 3, so b's counts are scaled by 9 / 4 to a's total."""
    from jaxspec.train.data import source_counts

    docs = [[1, 1, 1], [1, 1], [2, 2], [1, 1], [1, 1], [2, 3]]  # pass 0 then pass 1
    stream = np.concatenate([np.asarray(d, np.int32) for d in docs])
    np.save(tmp_path / "offsets.npy", np.cumsum([0] + [len(d) for d in docs]))
    meta = {"sources": {"a": {"prompts": 2}, "b": {"prompts": 1}}}
    got = source_counts(tmp_path, stream, meta, 5)
    np.testing.assert_array_equal(got, [0, 9, 7, 2, 0])  # 6.75 and 2.25, rounded
    assert got.dtype == np.int32
    one = {"sources": {"given": {"prompts": 3}}}  # one source: the plain counts
    np.testing.assert_array_equal(source_counts(tmp_path, stream, one, 5), [0, 9, 3, 1, 0])
    cut = {"sources": {"a": {"prompts": 2}, "b": {"prompts": 1}}}  # a budget cut: 4 documents
    np.save(tmp_path / "offsets.npy", np.cumsum([0] + [len(d) for d in docs[:4]]))
    np.testing.assert_array_equal(source_counts(tmp_path, stream[:9], cut, 5), [0, 7, 7, 0, 0])
    (tmp_path / "offsets.npy").write_bytes(b"junk")
    with pytest.raises(JaxspecError, match="unreadable"):
        source_counts(tmp_path, stream, meta, 5)
