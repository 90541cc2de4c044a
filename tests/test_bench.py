"""The benchmark runner on a tiny model: the JSON has the documented schema and the table one
row per method (no speed is asserted: that lives in benchmarks/RESULTS.md)."""

import json

import pytest

import jaxspec
from jaxspec import cli
from tests import hf_fixtures


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    src = tmp_path_factory.mktemp("hf")
    hf_fixtures.save_hf_checkpoint("llama3.2", src, tokenizer=True)
    return jaxspec.convert(
        src, tmp_path_factory.mktemp("ck") / "m", dtype="float32", progress=False
    )


def test_bench_writes_the_schema_and_prints_a_table(ckpt, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("w3 w4 w5 w3 w4\nw7 w8\nw9 w9 w9 w10\n")
    out = tmp_path / "r.json"
    code = cli.main(
        [
            "bench",
            "--model",
            str(ckpt),
            "--methods",
            "autoregressive,chain,tree",
            "--draft",
            "ngram",
            "--dataset",
            f"file:{prompts}",
            "--prompts",
            "3",
            "--max-new-tokens",
            "6",
            "--batch",
            "2",
            "--option",
            "gamma=3",
            "--option",
            "depth=2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    r = json.loads(out.read_text())
    for key in (
        "date",
        "device",
        "jax",
        "commit",
        "command",
        "dataset",
        "source",
        "prompts",
        "max_new_tokens",
        "batch",
        "methods",
    ):
        assert key in r, key
    assert r["prompts"] == 3 and r["batch"] == 2 and r["jax"] == jax_version()
    assert [m["method"] for m in r["methods"]] == ["autoregressive", "chain", "tree"]
    for m in r["methods"]:
        assert m["tokens_per_s"] > 0 and m["acceptance_length"] >= 1.0
        assert set(m["ms_per_token"]) == {"mean", "p50", "p95"}
        assert m["ms_per_token"]["p50"] <= m["ms_per_token"]["p95"]
        assert {"compile", "run"} <= set(m["time_split_s"])
        assert [p["prompt"] for p in m["per_prompt"]] == [0, 1, 2]
        assert sum(p["new_tokens"] for p in m["per_prompt"]) == m["new_tokens"]
    assert r["methods"][0]["speedup_vs_first"] == 1.0
    # each method gets the options it takes
    assert [m["options"] for m in r["methods"]] == [{}, {"gamma": 3}, {"depth": 2}]
    table = capsys.readouterr().out.strip().splitlines()
    assert len(table) == 4 and "tok/s" in table[0]
    assert [line.split()[0] for line in table[1:]] == ["autoregressive", "chain", "tree"]


def jax_version():
    import jax

    return jax.__version__


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--methods", "autoregressive,beam"], "unknown method"),
        (["--dataset", "squad"], "unknown dataset"),
        (["--option", "gamma=x"], "KEY=INT"),
        (["--batch", "0"], "--batch"),
        (["--option", "beams=2"], "takes beams"),
    ],
)
def test_bench_bad_arguments_exit_2(ckpt, argv, says, capsys):
    assert cli.main(["bench", "--model", str(ckpt), "--prompts", "1", *argv]) == 2
    assert says in capsys.readouterr().err
