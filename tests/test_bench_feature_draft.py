"""benchmarks/bench_feature_draft.py: the pooled acceptance of a row is its verifications'
tokens over its verifications (not a mean of per-prompt means), and the script runs end to end
on a tiny converted target with an untrained head, writing every row with the same tokens as
autoregressive decoding."""

import json

import pytest

import jaxspec
from benchmarks import bench_distill
from benchmarks import bench_feature_draft as B
from jaxspec.model.feature_head import random_head
from tests import hf_fixtures, tiny


def test_pooled_acceptance_weights_each_prompt_by_its_verifications():
    def run(acc, steps, new):
        return {"acceptance_length": acc, "target_steps": steps, "new_tokens": new,
                "wall_s": 1.0, "same_as_autoregressive": True}  # fmt: skip

    # 4 verifications of 4 tokens and 1 of 1: pooled 17 / 5, the per-prompt mean 2.5
    row = B.row_of("feature", [run(4.0, 5, 17), run(1.0, 2, 2)])
    assert row["acceptance_length_pooled"] == pytest.approx(3.4)
    assert row["acceptance_length_mean"] == pytest.approx(2.5)
    assert (row["target_verifications"], row["new_tokens"], row["tokens_per_s"]) == (5, 19, 9.5)
    assert B.row_of("autoregressive", [run(1.0, 9, 9)])["acceptance_length_pooled"] == 1.0


ARGS = "autoregressive,feature"


def test_a_run_cut_short_keeps_the_prompts_it_finished(tmp_path, monkeypatch):
    """A GPU call's time limit kills the script mid-set: the prompts done are in the file."""
    calls = []

    def timed_call(target, p, draft, method, opts, new):
        calls.append(p)
        if len(calls) == 2:  # the second prompt: the call's limit
            raise KeyboardInterrupt
        return type("R", (), {"tokens": [[1, 2]]})(), 1.0

    run = {"acceptance_length": 1.0, "target_steps": 2, "new_tokens": 2, "wall_s": 1.0,
           "same_as_autoregressive": True}  # fmt: skip
    monkeypatch.setattr(B, "default_target", lambda model: tiny.model(0))
    monkeypatch.setattr(B, "prompt_set", lambda target, name, n: ([[5], [6], [7]], "three"))
    monkeypatch.setattr(B, "timed_call", timed_call)
    monkeypatch.setattr(B, "run_of", lambda *a: dict(run))
    out = tmp_path / "fd.json"
    argv = ["--configs", "autoregressive", "--device-tag", "t", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        B.main(argv + ["--merge-from", str(out)])
    part = json.loads(out.read_text())["t"]["sets"]["humaneval"]
    assert not part["complete"] and part["results"][0]["prompts"] == 1


def test_a_missing_feature_draft_says_how_to_train_one(tmp_path):
    with pytest.raises(SystemExit, match="jaxspec distill --kind feature"):
        B.load_drafts(None, B.parse(["--feature", str(tmp_path / "no"), "--configs", ARGS]))
    with pytest.raises(SystemExit):  # argparse: rows start with autoregressive
        B.parse(["--configs", "feature"])


def test_each_row_takes_every_place_after_autoregressive_in_turn():
    names = ["autoregressive", "a", "b", "c"]
    orders = [B.call_order(names, i) for i in range(4)]
    assert all(o[0] == "autoregressive" and sorted(o) == sorted(names) for o in orders)
    assert [o[1:] for o in orders[:3]] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert orders[3] == orders[0] and B.call_order(["autoregressive"], 5) == ["autoregressive"]


def test_a_shaped_tree_row_names_its_depth_and_bs():
    assert B.config("feature-tree-5x15") == ("tree", "feature", {"depth": 5, "bs": 15})
    assert B.config("feature") == B.CONFIGS["feature"]
    B.parse(["--configs", "autoregressive,feature-tree-5x15"])
    for bad in ("feature-tree-5", "feature-tree-5x15x2", "feature-tree-ax3"):
        with pytest.raises(KeyError):
            B.config(bad)
        with pytest.raises(SystemExit):
            B.parse(["--configs", f"autoregressive,{bad}"])


@pytest.mark.slow
def test_bench_runs_on_a_tiny_target(tmp_path, capsys):
    src = tmp_path / "hf"
    hf_fixtures.save_hf_checkpoint("llama3.2", src, tokenizer=True)
    ckpt = jaxspec.convert(src, tmp_path / "m", dtype="float32", progress=False)
    out = tmp_path / "fd.json"
    argv = ["--model", str(ckpt), "--feature", "random", "--prompts", "2", "--new", "8"]
    argv += ["--configs", "autoregressive,feature,feature-tree", "--sets", "humaneval"]
    argv += ["--device-tag", "test", "--merge-from", str(out), "--out", str(out)]
    assert B.main(argv) == 0
    part = json.loads(out.read_text())["test"]["sets"]["humaneval"]
    assert part["complete"] and [r["name"] for r in part["results"]] == [
        "autoregressive",
        "feature",
        "feature-tree",
    ]
    for r in part["results"]:
        assert r["prompts"] == r["identical_to_autoregressive"] == 2
        assert r["acceptance_length_pooled"] >= 1.0
    assert "feature-tree" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_distill_feature_rows_run_the_engines_losslessly():
    """bench_distill's ``feature`` and ``feature-tree`` rows through its padded ``run_one``."""
    target, ids = tiny.model(0), tiny.prompts(0, lengths=(9,))[0]
    head = random_head(target)
    rows = bench_distill.configs(4, 64, 4, feature=True)
    assert [r[0] for r in rows[-2:]] == ["feature", "feature-tree"]
    want, _ = bench_distill.run_one(target, "autoregressive", None, ids, 64, 12, {})
    for _, method, _, opts in rows[-2:]:
        got, stats = bench_distill.run_one(target, method, head, ids, 64, 12, opts)
        assert got == want and stats["acceptance_length"] >= 1.0


def test_a_results_section_is_named_for_the_gpu(monkeypatch):
    """bench_distill and bench_feature_draft name their section by the device (an H100's rows
    once went into the "h200" section a runner named)."""
    from benchmarks import common

    class Dev:
        platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    monkeypatch.setattr(common.jax, "devices", lambda: [Dev()])
    assert common.device_tag() == "h100"
    Dev.device_kind = "NVIDIA H200"
    assert common.device_tag() == "h200"
    Dev.device_kind, Dev.platform = "cpu", "cpu"
    assert common.device_tag() == "cpu"
