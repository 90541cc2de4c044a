"""benchmarks/RESULTS.md is generated from results/ (the latest run per topic) and the notes, so it
cannot drift from them: every kept result has a section with its metadata, table, plots and note;
every layout, and a JSON of no known layout, gets a table; --check fails on a stale page."""

import json
import pathlib

import pytest

from benchmarks import make_results, plots


def assert_on_page(text: str, *parts: str) -> None:
    missing = [p for p in parts if p not in text]
    assert not missing, missing


def test_committed_results_page_is_the_generators_output():
    assert make_results.OUT.read_text() == make_results.render(), (
        "benchmarks/RESULTS.md is out of date: run python benchmarks/make_results.py"
    )
    assert make_results.main(["--check"]) == 0


def test_every_kept_result_has_a_section_with_its_metadata_table_plots_and_note():
    text = make_results.OUT.read_text()
    sections = {
        sec.split("`results/", 1)[1].split("`", 1)[0]: sec for sec in text.split("\n## ")[1:]
    }
    names = sorted(p.name for p in make_results.RESULTS.iterdir())
    assert names and all(n.endswith(".json") for n in names), names  # the latest runs, no logs
    assert sorted(sections) == names
    for name in names:
        sec, data = sections[name], json.loads((make_results.RESULTS / name).read_text())
        note = make_results.NOTES / name.replace(".json", ".md")
        meta, body = make_results.front_matter(note.read_text() if note.is_file() else "")
        m = make_results.metadata(data, meta)
        assert "not recorded" not in m.values(), (name, m)
        where = f"`results/{name}` · {m['date']} · {m['device']}"
        assert sec.splitlines()[2] == f"{where} · jax {m['jax']} · commit {m['commit']}", name
        assert f"\n\nCommand: `{m['command']}`" in sec, name
        assert "\n| --- |" in sec and body in sec, name
    for name, png in make_results.planned_plots():
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", (name, png)
        assert f"(plots/{png.name})" in text
    linked = {line.split("](plots/", 1)[1][:-1] for line in text.splitlines() if "](plots/" in line}
    assert sorted(p.name for p in make_results.PLOTS.glob("*.png")) == sorted(linked)


def test_each_gpu_runner_remakes_a_kept_result():
    """The runner a note names exists, and every runner of benchmarks/gpu/ is named by a note."""
    gpu = make_results.HERE / "gpu"
    named = set()
    for note in make_results.NOTES.glob("[!_]*.md"):
        runner = make_results.front_matter(note.read_text())[0].get("runner")
        if runner:
            script = runner.split()[0]
            assert (make_results.HERE.parent / script).is_file(), (note.name, runner)
            named.add(pathlib.Path(script).name)
    helpers = {"env.sh", "lib.sh"}
    # a runner that has never had its machine says so; once its result is kept it must lose that
    pending = {p.name for p in gpu.glob("*.sh") if "\n# pending: " in p.read_text()}
    assert not pending & named, pending & named
    runners = {p.name for p in gpu.glob("*.sh")} - helpers - pending
    assert sorted(runners) == sorted(named)


BENCH = {
    "date": "2026-12-01",
    "device": "CPU (2 cores, x86_64)",
    "jax": "0.11.2",
    "commit": "abc1234",
    "command": "jaxspec bench --peers hf,hf-assisted",
    "model": "tiny",
    "dataset": "humaneval",
    "source": "HumanEval, MIT licence",
    "chat_template": False,
    "reference": "autoregressive",
    "prompts": 2,
    "max_new_tokens": 8,
    "batch": 1,
    "methods": [
        {
            "method": "autoregressive",
            "draft": None,
            "options": {},
            "tokens_per_s": 20.0,
            "acceptance_length": 1.0,
            "ms_per_token": {"mean": 50.0, "p50": 50.0, "p95": 51.0},
            "tokens_match": 2,
            "speedup_vs_first": 1.0,
            "per_prompt": [{"prompt": 0, "acceptance_length": 1.0}] * 2,
        },
        {
            "method": "chain",
            "draft": "ngram",
            "options": {"gamma": 4},
            "tokens_per_s": 31.5,
            "acceptance_length": 2.5,
            "ms_per_token": {"mean": 31.0, "p50": 30.0, "p95": 40.0},
            "tokens_match": 2,
            "speedup_vs_first": 1.575,
            "per_prompt": [{"acceptance_length": 2.0}, {"acceptance_length": 3.0}],
        },
        {
            "method": "hf",
            "peer": True,
            "draft": None,
            "options": {},
            "device": "cpu",
            "dtype": "float32",
            "tokens_per_s": 12.25,
            "acceptance_length": 1.0,
            "ms_per_token": {"mean": 80.0, "p50": 80.0, "p95": 90.0},
            "tokens_match": 1,
            "speedup_vs_first": 0.6125,
            "per_prompt": [{"acceptance_length": 1.0}] * 2,
        },
        {"method": "hf-assisted", "peer": True, "draft": "x", "skipped": "no HF counterpart"},
    ],
}
MAGICDEC = {
    "date": "2026-12-01",
    "device": "NVIDIA H200",
    "jax": "0.11.2",
    "commit": "def5678",
    "command": "python3 benchmarks/bench_magicdec.py",
    "rows": [
        {"batch": b, "prefix": p, "draft": "self-snapkv", "gamma": g, "alpha": 0.8, "speedup": s}
        for b, p, g, s in [
            (1, 2048, 2, 0.9),
            (8, 2048, 2, 1.1),
            (8, 2048, 3, 1.25),
            (1, 4096, 2, 1.0),
        ]
    ],
}
MAGICDEC_8B = {  # no draft column, a predicted speedup, nested per-gamma values
    "rows": [
        {"batch": b, "prefix": 4096, "gamma": 3, "predicted_speedup": s, "t_v": {"1": 0.5}}
        for b, s in [(1, 0.8), (32, 1.4)]
    ],
}


def _distill_section(device, commit, tps):
    rows = [
        ("autoregressive", "autoregressive", tps, 1.0, 1.0),
        ("distilled", "chain", 2 * tps, 2.75, 2.0),
        ("ngram", "chain", 1.5 * tps, 2.25, 1.5),
    ]
    return {
        "date": "2026-12-01",
        "device": device,
        "jax": "0.11.2",
        "commit": commit,
        "command": "python benchmarks/bench_distill.py",
        "gamma": 4,
        "draft": {"layers": 2, "stored_bytes": 4000000},
        "results": [
            {
                "name": n,
                "method": m,
                "options": {"gamma": 4} if m == "chain" else {},
                "prompts": 2,
                "tokens_per_s": t,
                "acceptance_length_mean": a,
                "identical_to_autoregressive": 2,
                "speedup_vs_autoregressive": s,
                "per_prompt": [{"acceptance_length": a}, {"acceptance_length": a + 0.5}],
            }
            for n, m, t, a, s in rows
        ],
    }


DISTILL = {
    "cpu": _distill_section("CPU (2 cores, x86_64)", "1111111", 20.0),
    "h200": _distill_section("NVIDIA H200 x2", "2222222", 700.0),
    "date": "2026-12-01",
    "device": "NVIDIA H200 x2",
    "what": "acceptance per draft",
}
UNKNOWN = {
    "date": "2026-12-02",
    "device": "NVIDIA H200",
    "jax": "0.11.2",
    "ms_per_token": 4.125,
    "label": "new",
    "nested": {"a": 1, "b": [1, 2]},
    "rows": [{"case": f"c{i}", "ms": i / 8, "detail": {"x": i}} for i in range(25)],
}
SMALL = {  # bench_small_model.py's figures: a section per context, a row per run
    "model": "SmolLM2",
    "new_tokens": 128,
    "runs": {"chain_ngram": {"method": "chain", "gamma": 8}},
    "ctx1024": {
        "rows": {
            "autoregressive": {
                "wall_tok_per_s": 1000.0,
                "acceptance_length": 1.0,
                "outside_ms": 0.8,
            },
            "chain_ngram": {"wall_tok_per_s": 2000.0, "acceptance_length": 2.1, "outside_ms": 1.1},
        },
        "first_token_ms": 4.5,
    },
    "ctx4096": {
        "rows": {
            "autoregressive": {"wall_tok_per_s": 800.0, "acceptance_length": 1.0, "outside_ms": 0.9}
        }
    },
    "peer_tok_per_s_b1": 1200.0,
}


@pytest.fixture
def folders(tmp_path, monkeypatch):
    for name in ("results", "notes", "plots"):
        (tmp_path / name).mkdir()
    monkeypatch.setattr(make_results, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(make_results, "NOTES", tmp_path / "notes")
    monkeypatch.setattr(make_results, "PLOTS", tmp_path / "plots")
    monkeypatch.setattr(make_results, "OUT", tmp_path / "RESULTS.md")
    return tmp_path


def test_sections_for_each_layout_in_page_order(folders):
    res, notes = folders / "results", folders / "notes"
    (res / "bench_cpu.json").write_text(json.dumps(BENCH))
    (res / "magicdec.json").write_text(json.dumps(MAGICDEC))
    (res / "magicdec_8b.json").write_text(json.dumps(MAGICDEC_8B))
    (notes / "_intro.md").write_text("Intro prose.\n")
    (notes / "bench_cpu.md").write_text(
        "---\ntitle: Bench\nrunner: benchmarks/gpu/bench.sh\n---\nWords.\n"
    )
    text = make_results.render()
    heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
    assert heads == ["## Bench", "## magicdec", "## magicdec 8b"]  # ORDER, then by name
    assert text.startswith("# Results\n") and "Intro prose." in text
    where = "`results/bench_cpu.json` · 2026-12-01 · CPU (2 cores, x86_64)"
    assert_on_page(
        text,
        # the contents list links every section, with its device and date
        "- [Bench](#bench) · CPU (2 cores, x86_64) · 2026-12-01",
        "- [magicdec 8b](#magicdec-8b) · not recorded · not recorded",
        # bench: its metadata and runner, one row per method and peer, setup line, plots, note
        f"{where} · jax 0.11.2 · commit abc1234",
        "Command: `jaxspec bench --peers hf,hf-assisted`",
        "Re-run on a GPU: `bash benchmarks/gpu/bench.sh`",
        "| chain | ngram | gamma 4 | 31.5 | 2.5 | 30 | 40 | 1.575x | 2/2 |",
        "| hf (HF, cpu, float32) | - | - | 12.25 | 1 | 80 | 90 | 0.6125x | 1/2 |",
        "skipped: no HF counterpart",
        "2 prompts of HumanEval, MIT licence",
        "(plots/bench_cpu_tokens_per_s.png)",
        "(plots/bench_cpu_acceptance.png)",
        "Words.",
        # magicdec: the rows tables and the speedup plots
        "| batch | prefix | draft | gamma | alpha | speedup |",
        "| 8 | 2048 | self-snapkv | 3 | 0.8 | 1.25 |",
        "(plots/magicdec_speedup.png)",
        "| batch | prefix | gamma | predicted_speedup |",
        "| 32 | 4096 | 3 | 1.4 |",
        "not shown: `t_v`.",
        "(plots/magicdec_8b_speedup.png)",
    )
    assert text.count("Re-run on a GPU") == 1  # no runner line without a note naming one


def test_a_new_json_dropped_in_appears_with_the_generic_table(folders):
    (folders / "results" / "zz_new.json").write_text(json.dumps(UNKNOWN))
    (folders / "results" / "a_list.json").write_text(json.dumps([1, 2]))
    text = make_results.render()
    assert "\n## zz new\n" in text and "\n## a list\n" in text
    assert (
        "`results/zz_new.json` · 2026-12-02 · NVIDIA H200 · jax 0.11.2 · commit not recorded"
        in text
    )
    assert "| `ms_per_token` | 4.125 |" in text and "| `label` | new |" in text
    assert "| case | ms |" in text and "| c19 | 2.375 |" in text and "| c20 |" not in text
    assert "(5 more rows in the JSON.)" in text and "not shown: `detail`." in text
    assert "Also in the JSON: `nested`." in text
    assert "| `values` | 1, 2 |" in text


def test_front_matter_chooses_the_table(folders):
    """keys (with labels, over continued lines), columns and pivot replace the layout's table."""
    (folders / "results" / "magicdec.json").write_text(json.dumps(MAGICDEC))
    (folders / "notes" / "magicdec.md").write_text(
        "---\n"
        "title: Views\n"
        "keys: date = run on;\n"
        "  command; no.such.key\n"
        "columns: prefix, speedup\n"
        "pivot: prefix, batch | gamma | {speedup:.2f}x ({draft})\n"
        "commit: from the note\n"
        "device: not used: the JSON has one\n"
        "---\n"
        "Note.\n"
    )
    text = make_results.render()
    assert_on_page(
        text,
        "| run on | 2026-12-01 |",
        "| `command` | python3 benchmarks/bench_magicdec.py |",
        "| `no.such.key` | - |",
        "| prefix | speedup |\n| --- | --- |\n| 2048 | 0.9 |",
        "| prefix | batch | gamma 2 | gamma 3 |",
        "| 2048 | 8 | 1.10x (self-snapkv) | 1.25x (self-snapkv) |",
        "| 4096 | 1 | 1.00x (self-snapkv) | - |",
    )
    assert "| batch | prefix | draft | gamma | alpha | speedup |" not in text  # the layout's table
    assert "· NVIDIA H200 · jax 0.11.2 · commit def5678" in text  # the JSON's own win
    (folders / "results" / "magicdec.json").write_text(json.dumps({**MAGICDEC, "commit": None}))
    assert "· commit from the note" in make_results.render()


def test_small_model_figures_get_their_table(folders):
    (folders / "results" / "small_model.json").write_text(json.dumps(SMALL))
    text = make_results.render()
    head = "| run | draft options | 1024 tokens: tok/s (vs AR) | acceptance | outside ms |"
    assert head + " 4096 tokens: tok/s (vs AR) | acceptance | outside ms |" in text
    assert_on_page(
        text,
        "| autoregressive | - | 1000.0 | 1 | 0.8 | 800 | 1 | 0.9 |",
        "| chain_ngram | method chain, gamma 8 | 2000.0 (2.00x) | 2.1 | 1.1 | - | - | - |",
        "first token after 1024 prompt tokens: 4.5 ms",
        "PyTorch CUDA-graph peer: 1200.0 tok/s",
        "model SmolLM2, new_tokens 128",
    )


def test_notes_without_a_json_and_stray_files_are_errors(folders, capsys):
    (folders / "results" / "kept.json").write_text(json.dumps(UNKNOWN))
    (folders / "notes" / "gone.md").write_text("A note whose run was deleted.\n")
    with pytest.raises(ValueError, match="gone.md"):
        make_results.render()
    assert make_results.main(["--no-plots"]) == 1
    assert "gone.md" in capsys.readouterr().err and not make_results.OUT.exists()
    (folders / "notes" / "gone.md").unlink()
    (folders / "results" / "kept.log").write_text("a log\n")
    with pytest.raises(ValueError, match="kept.log"):
        make_results.render()
    (folders / "results" / "kept.log").unlink()
    assert make_results.main(["--no-plots"]) == 0


def test_bench_time_split_gets_a_column(folders):
    """A bench JSON whose rows carry a time split shows it as percentages (peers without one:
    "-"); a JSON without any keeps the table as it was (the test above)."""
    fr = {"draft": 0.05, "verify": 0.7, "handoff": 0.0, "prefill": 0.1, "host": 0.15}
    rows = [dict(r) for r in BENCH["methods"]]
    rows[1]["time_split"] = {"fractions": fr, "host_clamped": False}
    rows[0]["time_split"] = {"fractions": {**fr, "host": 0.0}, "host_clamped": True, "host_s": 0}
    rows[2] = {**rows[2], "peer": False, "time_split": {"fractions": fr, "host_clamped": True}}
    rows[2]["time_split"]["host_s"] = 0.2
    (folders / "results" / "bench_cpu.json").write_text(json.dumps({**BENCH, "methods": rows}))
    text = make_results.render()
    assert "| time split: draft / verify / handoff / prefill / host |" in text
    assert "| 1.575x | 2/2 | 5.0% / 70.0% / 0.0% / 10.0% / 15.0% |" in text
    assert "| 1x | 2/2 | 5.0% / 70.0% / 0.0% / 10.0% / 0.0% (clamped) |" in text
    assert "| 0.6125x | 1/2 | 5.0% / 70.0% / 0.0% / 10.0% / 15.0% (clamped in some runs) |" in text
    rows[2] = BENCH["methods"][2]
    (folders / "results" / "bench_cpu.json").write_text(json.dumps({**BENCH, "methods": rows}))
    text = make_results.render()
    assert "| 0.6125x | 1/2 | - |" in text and "component timings x counts" in text


def test_per_device_sections_get_their_own_tables_and_plots(folders, tmp_path):
    (folders / "results" / "distill.json").write_text(json.dumps(DISTILL))
    text = make_results.render()
    assert "\n## distill\n" in text
    cpu, h200 = text.split("### cpu")[1].split("### h200")
    assert "CPU (2 cores, x86_64) · jax 0.11.2 · commit 1111111" in cpu
    assert "| chain | distilled | gamma 4 | 40 | 2.75 | 2x | 2/2 |" in cpu
    assert "| chain | distilled | gamma 4 | 1400.0 | 2.75 | 2x | 2/2 |" in h200
    assert "draft.stored_bytes" not in text and "| `what` |" not in text  # compact: tables only
    files = [p.file for p in plots.plans("distill", DISTILL)]
    assert files == [
        "distill_cpu_tokens_per_s.png",
        "distill_cpu_acceptance.png",
        "distill_h200_tokens_per_s.png",
        "distill_h200_acceptance.png",
    ]
    for f in files:
        assert text.count(f"(plots/{f})") == 1
    written = plots.draw_all([folders / "results" / "distill.json"], tmp_path / "png")
    assert sorted(p.name for p in written) == sorted(files)


def test_a_known_layout_missing_fields_falls_back_to_the_generic_table(folders):
    odd = {"results": [{"impl": "ours", "B": 1, "note": "no timings"}], "date": "2026-12-02"}
    (folders / "results" / "kernels_new.json").write_text(json.dumps(odd))
    text = make_results.render()
    assert "| impl | B | note |" in text and "| ours | 1 | no timings |" in text


def test_check_mode_fails_on_a_stale_page(folders):
    (folders / "results" / "zz_new.json").write_text(json.dumps(UNKNOWN))
    assert make_results.main(["--no-plots"]) == 0
    assert make_results.main(["--check"]) == 0
    (folders / "results" / "zz_new.json").write_text(json.dumps({**UNKNOWN, "ms_per_token": 5}))
    assert make_results.main(["--check"]) == 1
    assert make_results.main(["--no-plots"]) == 0 and make_results.main(["--check"]) == 0
    (folders / "results" / "magicdec.json").write_text(json.dumps(MAGICDEC))  # a plotted layout
    assert make_results.main(["--no-plots"]) == 0
    assert make_results.main(["--check"]) == 1  # its plot is missing


def test_plots_are_drawn_from_the_jsons(tmp_path):
    files = []
    throughput = {"rows": [dict(r, throughput_speedup=1.2) for r in MAGICDEC["rows"]]}
    cases = (("bench_cpu", BENCH), ("magicdec", MAGICDEC), ("m8", MAGICDEC_8B), ("zz", UNKNOWN))
    cases += (("md2", throughput),)
    for name, data in cases:
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(data))
    assert [p.kind for p in plots.plans("bench_cpu", BENCH)] == ["tokens_per_s", "acceptance"]
    assert [p.kind for p in plots.plans("magicdec", MAGICDEC)] == ["speedup"]
    assert [p.kind for p in plots.plans("md2", throughput)] == ["speedup", "throughput"]
    assert plots.plans("zz", UNKNOWN) == []
    # the acceptance histogram shows speculative rows only; the speedup plot the best gamma
    assert [r["method"] for r in plots.method_rows(BENCH) if plots.speculative(r)] == ["chain"]
    written = plots.draw_all(files, tmp_path / "out")
    assert sorted(p.name for p in written) == [
        "bench_cpu_acceptance.png",
        "bench_cpu_tokens_per_s.png",
        "m8_speedup.png",
        "magicdec_speedup.png",
        "md2_speedup.png",
        "md2_throughput.png",
    ]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
