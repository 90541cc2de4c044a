"""bench_feature_ttt's runs: a finished run of the same recipe and data is measured again, not
trained again; another recipe trains anew, on the data it is given."""

import json

from benchmarks.bench_feature_ttt import trained
from tests import tiny
from tests.test_feature_distill import PROMPTS

OPTIONS = dict(
    kind="feature", intermediate=32, seq_len=32, batch=4, steps=4, warmup=2, samples=1,
    max_new=16, gen_batch=4, prompts=PROMPTS, progress=False,
)  # fmt: skip


def test_a_finished_run_is_reused_and_another_recipe_trains_on_the_given_data(tmp_path):
    target = tiny.model(0)
    first, s1 = trained(target, tmp_path / "a", OPTIONS, None)
    assert s1 > 0 and (first / "draft.json").is_file()
    again, s2 = trained(target, tmp_path / "a", OPTIONS, None)
    assert again == first and s2 == 0.0
    other, s3 = trained(
        target, tmp_path / "b", {**OPTIONS, "ttt_steps": 2}, tmp_path / "a" / "data"
    )
    assert s3 > 0
    meta = [json.loads((p / "draft.json").read_text())["training"] for p in (first, other)]
    assert meta[0]["data"] == meta[1]["data"] and meta[1]["recipe"]["ttt_steps"] == 2
    changed, s4 = trained(target, tmp_path / "a", {**OPTIONS, "steps": 5}, None)
    assert s4 > 0 and json.loads((changed / "draft.json").read_text())["training"]["steps"] == 5
