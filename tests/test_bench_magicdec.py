"""The MagicDec benchmark scripts on tiny settings (slow: they compile many shapes): their JSON
has the documented schema, and in float32 the speculative tokens equal autoregressive ones."""

import json

import pytest

import jaxspec
from benchmarks import bench_magicdec, bench_magicdec_8b
from tests import hf_fixtures


def test_throughput_ratio_counts_every_row_without_the_first_token():
    # autoregressive: 2 rows x 9 decoded tokens in 1 s; speculative: 9 + 4 in 0.5 s
    assert bench_magicdec.throughput_ratio([10, 10], 1.0, [10, 5], 0.5) == pytest.approx(
        (13 / 0.5) / 18
    )
    assert bench_magicdec.throughput_ratio([5, 5], 2.0, [5, 5], 1.0) == pytest.approx(2.0)


def test_prefix_agreement():
    ar = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    sd = [[1, 2, 0, 0], [5, 7, 0, 0], [9, 9, 9, 9]]
    # row 0: 2 tokens, a prefix; row 1 differs at index 1; row 2 longer than autoregressive's
    assert bench_magicdec.prefix_agreement(ar, [4, 4, 3], sd, [2, 2, 4]) == 1
    assert bench_magicdec.prefix_agreement(ar, [4, 4, 4], sd, [2, 1, 4]) == 3


@pytest.mark.slow
def test_bench_magicdec_tiny(tmp_path):
    src = tmp_path / "hf"
    hf_fixtures.save_hf_checkpoint("llama3.2", src, tokenizer=True)
    ckpt = jaxspec.convert(src, tmp_path / "m", dtype="float32", progress=False)
    out = tmp_path / "md.json"
    argv = ["--model", str(ckpt), "--prefixes", "40,70", "--batches", "2", "--new", "6"]
    argv += ["--budget", "24", "--gammas", "1,2", "--reps", "1"]
    argv += ["--tree", "2,2,2,3"]
    assert bench_magicdec.main([*argv, "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "command", "rows", "dataset", "settings"):
        assert key in r
    assert len(r["rows"]) == 2 * 2  # prefixes x drafts
    for row in r["rows"]:
        for key in ("batch", "prefix", "draft", "gamma", "alpha", "speedup"):
            assert key in row
        assert row["chain_gamma"] in (1, 2) and 0.0 <= row["alpha"] <= 1.0 and row["speedup"] > 0
        # gamma is chosen at the slowest row's alpha, which is at most the mean row's
        assert 0.0 <= row["batch_alpha"] <= row["alpha"] + 1e-9
        pred = row["predicted_by_gamma"]
        assert str(row["chain_gamma"]) == max(pred, key=pred.get)  # JSON keys are strings
        assert row["rows_identical"] == row["rows"] == 2  # float32: exact
        # the throughput run stops at the fastest row: no more steps, rows hold prefixes
        assert row["throughput_rows_prefix_identical"] == 2
        assert 1 <= row["throughput_steps"] <= row["steps"] and row["throughput_speedup"] > 0
        assert set(row["throughput_by_gamma"]) == set(row["measured_by_gamma"])
        assert set(row["all_gammas_rows_identical"].values()) == {2}
        assert row["prefix_tokens_mean"] == row["prefix"]
        tree = row["tree"]
        assert tree["depth"] == 2 and tree["rows_identical"] == 2
        assert 1.0 <= tree["acceptance_length"] <= 3.0 and tree["t_e_ms"] > 0
        assert row["shape"] == (
            "tree" if tree["predicted_speedup"] > row["chain_predicted_speedup"] else "chain"
        )
        assert row["gamma"] == (row["chain_gamma"] if row["shape"] == "chain" else None)


@pytest.mark.slow
def test_bench_magicdec_8b_smoke(tmp_path):
    out = tmp_path / "8b.json"
    argv = ["--smoke", "--batches", "1,4", "--prefixes", "256,1024,4096", "--kv-gib", "0.01"]
    argv += ["--budget", "64", "--reps", "1", "--out", str(out)]
    assert bench_magicdec_8b.main(argv) == 0
    r = json.loads(out.read_text())
    sources = {(row["batch"], row["prefix"]): row["source"] for row in r["rows"]}
    assert sources[(1, 4096)] == "measured" and sources[(4, 4096)] == "analytic"
    assert len(sources) == 6
    for row in r["rows"]:
        assert 1 <= row["gamma"] <= 8 and row["predicted_speedup"] > 0
        assert {int(g) for g in row["t_v_over_t_t"]} == set(range(1, 9))
