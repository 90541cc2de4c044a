"""The benchmark runner on a tiny model: the JSON has the documented schema and the table one
row per method (no speed is asserted: that lives in benchmarks/RESULTS.md)."""

import json

import pytest

import jaxspec
from jaxspec import cli
from jaxspec.io import datasets
from jaxspec.measure import bench, time_split
from jaxspec.prompts import encode_prompts
from tests import hf_fixtures

# wraps each user turn in marker words, so a test can see the template was applied
TEMPLATE = "{% for m in messages %}w5 w6 {{ m['content'] }} w6 w5{% endfor %}"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    src = tmp_path_factory.mktemp("hf")
    hf_fixtures.save_hf_checkpoint("llama3.2", src)
    tok = hf_fixtures.make_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(src)
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
    assert r["time_split"] is True
    for m in r["methods"]:
        check_time_split(m)
    ar, chain, tree = r["methods"]
    assert ar["time_split"]["draft_s"] == 0 and ar["time_split"]["counts"]["draft_steps"] == 0
    assert chain["time_split"]["counts"]["draft_steps"] > 0  # ngram's lookup: microseconds
    assert "gamma=3" in chain["time_split"]["draft_unit"]
    assert "depth=2" in tree["time_split"]["draft_unit"]
    # batches of 2 and 1 prompts: two run shapes, each measured once
    assert [u["rows"] for u in ar["time_split"]["units_ms"]] == [2, 1]
    assert ar["time_split"]["counts"]["runs"] == 2
    # each method gets the options it takes
    assert [m["options"] for m in r["methods"]] == [{}, {"gamma": 3}, {"depth": 2}]
    table = capsys.readouterr().out.strip().splitlines()
    assert len(table) == 4 and "tok/s" in table[0]
    assert [line.split()[0] for line in table[1:]] == ["autoregressive", "chain", "tree"]
    # the split's percentages, in the order of the head's columns
    head = table[0].split()
    cols = [head.index(f"{p}%") - len(head) for p in time_split.PARTS]
    for line, m in zip(table[1:], r["methods"], strict=True):
        cells = line.split()
        for p, c in zip(time_split.PARTS, cols, strict=True):
            assert float(cells[c].rstrip("*")) == pytest.approx(
                100 * m["time_split"]["fractions"][p], abs=0.051
            ), (m["method"], p)


def check_time_split(m):
    """A method's time split: every part present and non-negative, the parts sum to the wall
    (beyond it only by the reported overshoot when host was clamped), shares that sum to one,
    and every prompt carries its batch's shares."""
    ts = m["time_split"]
    assert ts["method"] == "component timings x counts" and "host" in ts["how"]
    parts = [ts[f"{p}_s"] for p in time_split.PARTS]
    assert all(x >= 0 for x in parts), ts
    assert ts["wall_s"] == pytest.approx(m["time_split_s"]["run"], abs=1e-5)
    over = ts.get("overshoot_s", 0.0)
    assert ts["host_clamped"] == (over > 0)  # some run's parts exceeded its wall
    assert sum(parts) == pytest.approx(ts["wall_s"] + over, abs=1e-4), ts
    assert ts["verify_s"] > 0 and ts["prefill_s"] > 0 and ts["prefill_measured"]
    assert sum(ts["fractions"].values()) == pytest.approx(1.0, abs=1e-3)
    assert ts["counts"]["loop_steps"] > 0 and ts["measure_s"] > 0
    for u in ts["units_ms"]:
        assert u["verify_ms"] > 0 and u["prefill_ms"] > 0 and u["draft_ms"] >= 0
    for p in m["per_prompt"]:
        assert set(p["time_split"]) == set(time_split.PARTS)
        assert sum(p["time_split"].values()) == pytest.approx(1.0, abs=1e-3)


def test_no_time_split_skips_the_measurement(ckpt, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["bench", "--model", str(ckpt), "--methods", "autoregressive", "--prompts", "1"]
    assert cli.main([*argv, "--max-new-tokens", "3", "--no-time-split", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["time_split"] is False and "time_split" not in r["methods"][0]
    assert "time_split" not in r["methods"][0]["per_prompt"][0]
    row = capsys.readouterr().out.strip().splitlines()[1].split()
    assert row[-6:-1] == ["-"] * 5


def test_time_split_attribution_counts_units_and_clamps_the_host():
    units = time_split.Units(1, 16, 20, 4.0, 2.0, 10.0, "d", "v", 0.5)
    stats = {"wall_s": 1.0, "target_steps": 51, "draft_steps": 200}
    s = time_split.attribute(stats, units, "chain")
    assert s["draft_s"] == pytest.approx(0.1) and s["verify_s"] == pytest.approx(0.5)
    assert s["prefill_s"] == pytest.approx(0.004) and s["handoff_s"] == 0
    assert s["host_s"] == pytest.approx(0.396) and not s["host_clamped"]
    assert time_split.attribute(stats, units, "autoregressive")["draft_s"] == 0
    # swiftspec: counts of its own, its handoff, the draft overlapping the verify
    sw = {"wall_s": 1.0, "target_steps": 61, "verify_steps": 60, "draft_expansions": 300}
    s = time_split.attribute({**sw, "handoff_s": 0.05}, units, "swiftspec")
    assert s["draft_s"] == pytest.approx(0.6) and s["verify_s"] == pytest.approx(0.6)
    assert s["host_clamped"] and s["host_s"] == 0
    assert s["overshoot_s"] == pytest.approx(0.6 + 0.6 + 0.05 + 0.004 - 1.0)
    whole = time_split.summarize([s], [units], {})
    assert whole["host_clamped"] and whole["overshoot_s"] == pytest.approx(s["overshoot_s"])
    assert sum(whole["fractions"].values()) == pytest.approx(1.0, abs=1e-3)


def test_bench_peers_and_the_chat_set(ckpt, tmp_path, capsys):
    """HF peers on the same weights (plain, and assisted with the same draft checkpoint) give
    the reference's tokens in float32; the chat set is encoded with the chat template."""
    out = tmp_path / "r.json"
    argv = ["bench", "--model", str(ckpt), "--methods", "autoregressive,chain"]
    argv += ["--draft", str(ckpt), "--dataset", "chat", "--prompts", "2"]
    argv += ["--max-new-tokens", "5", "--option", "gamma=2", "--peers", "hf,hf-assisted"]
    # the time split (its own compiles) is the schema test's
    assert cli.main([*argv, "--no-time-split", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["dataset"] == "chat" and "MT-Bench" in r["source"] and r["chat_template"] is True
    assert r["reference"] == "autoregressive"
    assert [m["method"] for m in r["methods"]] == ["autoregressive", "chain", "hf", "hf-assisted"]
    m = jaxspec.load(ckpt)
    want = encode_prompts(datasets.chat(2), m.tokenizer, m.config, chat=True)
    plain = encode_prompts(datasets.chat(2), m.tokenizer, m.config)
    assert [w[:2] for w in want] == [[5, 6], [5, 6]] and want != plain
    ref = jaxspec.generate(m, want, max_new_tokens=5).tokens
    for row in r["methods"]:
        assert row["tokens_match"] == row["tokens_compared"] == 2, row["method"]
        assert [p["prompt_tokens"] for p in row["per_prompt"]] == [len(w) for w in want]
        assert [p["new_tokens"] for p in row["per_prompt"]] == [len(t) for t in ref]
        assert all(p["matches_reference"] and p["first_diff"] is None for p in row["per_prompt"])
        assert row["tokens_per_s"] > 0 and row["speedup_vs_first"] > 0
    hf, assisted = r["methods"][2:]
    assert hf["peer"] and hf["device"] == "cpu" and hf["dtype"] == "float32" and hf["threads"] >= 1
    assert hf["acceptance_length"] == 1.0 and hf["draft"] is None
    assert assisted["draft"] == ckpt.name and assisted["options"] == {"gamma": 2}
    # the draft is the target itself: every drafted token is accepted, up to gamma + 1
    assert assisted["acceptance_length"] > 1.0
    assert {"warmup", "run"} <= set(hf["time_split_s"])
    table = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in table[1:]] == [m["method"] for m in r["methods"]]
    assert all(line.split()[-1] == "2/2" for line in table[1:])


def test_bench_peer_without_an_hf_counterpart_is_skipped_not_fatal(ckpt, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["bench", "--model", str(ckpt), "--methods", "autoregressive", "--prompts", "1"]
    argv += ["--draft", "self-streaming", "--max-new-tokens", "3", "--peers", "hf-assisted"]
    assert cli.main([*argv, "--no-time-split", "--out", str(out)]) == 0
    peer = json.loads(out.read_text())["methods"][1]
    assert peer["method"] == "hf-assisted" and "self-streaming" in peer["skipped"]
    assert "skipped" in capsys.readouterr().out


def test_budget_truncates_then_skips_and_each_update_is_a_full_result(ckpt, tmp_path):
    """A clock that advances 1 s per reading and a 2.5 s budget: the first method runs two of
    its three batches, later runs are skipped; every update is a complete, comparable result."""
    ticks = iter(range(1000))
    updates = []
    m = jaxspec.load(ckpt)
    r = bench.run(
        m,
        methods=["autoregressive", "chain"],
        draft="ngram",
        prompts=["w3 w4 w5", "w7 w8", "w9 w10"],
        source="test",
        dataset="test",
        max_new_tokens=3,
        batch=1,
        options={},
        progress=False,
        peers=["hf"],
        budget_s=2.5,
        on_update=updates.append,
        clock=lambda: next(ticks),
        time_split=False,  # the schema test's; the budget reads only this clock
    )
    ar, chain, hf = r["methods"]
    assert ar["truncated"] and [p["prompt"] for p in ar["per_prompt"]] == [0, 1]
    assert ar["tokens_match"] == ar["tokens_compared"] == 2 and ar["new_tokens"] > 0
    assert "budget" in chain["skipped"] and "budget" in hf["skipped"] and hf["peer"]
    assert r["budget_s"] == 2.5 and r["reference"] == "autoregressive"
    assert len(updates) == 1 and updates[0]["methods"][0] == ar
    assert "skipped" in bench.table(r).splitlines()[2]


def test_compare_finds_the_first_difference():
    assert bench.compare([1, 2, 3], [1, 2, 3]) == {"matches_reference": True, "first_diff": None}
    assert bench.compare([1, 5, 3], [1, 2, 3])["first_diff"] == 1
    assert bench.compare([1, 2], [1, 2, 3]) == {"matches_reference": False, "first_diff": 2}
    assert bench.compare([1], None) == {}


def test_results_record_the_resolved_kernels_not_the_environment(ckpt, tmp_path, monkeypatch):
    """The JSON keeps the kernel configuration the run resolved (every choice concrete), not
    environment variables (and never paths: JAXSPEC_DEFAULT_GGUF says where a file is)."""
    from jaxspec.kernels import KernelConfig
    from jaxspec.provenance import metadata

    monkeypatch.setenv("JAXSPEC_FUSED_ATTENTION", "interpret")
    monkeypatch.setenv("JAXSPEC_DEFAULT_GGUF", "/somewhere/smol.gguf")
    meta = metadata()
    assert "jaxspec_env" not in meta and "/somewhere" not in json.dumps(meta)
    monkeypatch.delenv("JAXSPEC_FUSED_ATTENTION")
    m = jaxspec.load(ckpt)
    kw = dict(
        methods=["autoregressive"], draft=None, prompts=["w3 w4 w5"], source="test",
        dataset="test", max_new_tokens=2, batch=1, options={}, progress=False,
        time_split=False,
    )  # fmt: skip
    padded = KernelConfig(gemm_rows=8)
    r = bench.run(m, kernels=padded, **kw)
    assert r["kernels"] == m.net(padded).kernels.describe()
    assert r["kernels"]["gemm_rows"] == 8 and r["kernels"]["attention"] == "reference"
    assert "auto" not in r["kernels"].values() and "resolved" not in r["kernels"]
    assert bench.run(m, **kw)["kernels"]["gemm_rows"] == 0  # the CPU default
    # the CLI reads the JAXSPEC_* variables into the config it hands the bench
    monkeypatch.setenv("JAXSPEC_MIN_GEMM_ROWS", "8")
    out = tmp_path / "r.json"
    argv = ["bench", "--model", str(ckpt), "--methods", "autoregressive", "--prompts", "1"]
    assert cli.main([*argv, "--max-new-tokens", "2", "--no-time-split", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["kernels"]["gemm_rows"] == 8


def test_recorded_command_is_the_one_typed():
    from jaxspec.provenance import _command

    assert _command(["/v/bin/jaxspec", "bench", "--prompts", "8"]) == "jaxspec bench --prompts 8"
    assert _command(["/r/jaxspec/cli.py", "bench"]) == "jaxspec bench"
    assert _command(["benchmarks/x.py", "--n", "2"]).endswith("python benchmarks/x.py --n 2")


def jax_version():
    import jax

    return jax.__version__


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--methods", "autoregressive,beam"], "unknown method"),
        (["--dataset", "squad"], "unknown dataset"),
        (["--option", "gamma=x"], "gamma must be an integer"),
        (["--batch", "0"], "--batch"),
        (["--peers", "vllm"], "unknown peer"),
        (["--methods", ","], "at least one method"),
        (["--budget-s", "0"], "--budget-s"),
        (["--option", "beams=2"], "takes beams"),
        (["--option", "loop=gpu", "--methods", "swiftspec"], "loop must be one of"),
    ],
)
def test_bench_bad_arguments_exit_2(ckpt, argv, says, capsys):
    assert cli.main(["bench", "--model", str(ckpt), "--prompts", "1", *argv]) == 2
    assert says in capsys.readouterr().err
