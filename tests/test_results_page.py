"""benchmarks/RESULTS.md is generated from the JSONs and notes (so it cannot drift from them),
every layout gets a section, and the plots are drawn from the JSONs."""

import json

import pytest

from benchmarks import make_results, plots


def test_committed_results_page_is_the_generators_output():
    text = make_results.render()
    assert make_results.OUT.read_text() == text, (
        "benchmarks/RESULTS.md is out of date: run python benchmarks/make_results.py"
    )
    for name, png in make_results.planned_plots():
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", (name, png)
        assert f"(plots/{png.name})" in text
    # every result file has its section, and every section says where its numbers come from
    for path in make_results.RESULTS.glob("*.json"):
        assert f"`results/{path.name}` · " in text, path.name
    sections = text.split("\n## ")[1:]
    assert sections and all("\nCommand: `" in sec for sec in sections), [
        sec.splitlines()[0] for sec in sections if "\nCommand: `" not in sec
    ]


def test_every_hand_written_note_is_on_the_page():
    text = make_results.OUT.read_text()
    for path in make_results.NOTES.glob("*.md"):
        _, body = make_results.front_matter(path.read_text())
        assert body in text, path.name


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
UNKNOWN = {"device": "NVIDIA H200", "ms_per_token": 4.125, "nested": {"a": 1, "b": [1, 2]}}


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
    (res / "zz_new.json").write_text(json.dumps(UNKNOWN))
    (res / "old_run.log").write_text("a log\n")
    (notes / "_intro.md").write_text("Intro prose.\n")
    (notes / "zz_new.md").write_text(
        "---\ntitle: A new result\ncommit: 9999999\ndevice: ignored\n---\nWhat it means.\n"
    )
    (notes / "old_run.md").write_text("---\ntitle: Only a log\n---\nThe log said 3.\n")
    text = make_results.render()
    heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
    assert heads == [
        "## `jaxspec bench` with HF peers, CPU",
        "## MagicDec: batched long-context speculation, one H200",
        "## MagicDec cost model at Llama-3.1-8B shape",
        "## Only a log",
        "## A new result",
    ]
    assert text.startswith("# Results\n") and "Intro prose." in text
    # bench: one row per method and peer, token match, skipped peer, setup line, plots
    assert "| chain | ngram | gamma 4 | 31.5 | 2.5 | 30 | 40 | 1.575x | 2/2 |" in text
    assert "| hf (HF, cpu, float32) | - | - | 12.25 | 1 | 80 | 90 | 0.6125x | 1/2 |" in text
    assert "skipped: no HF counterpart" in text
    assert "2 prompts of HumanEval, MIT licence" in text
    assert "(plots/bench_cpu_tokens_per_s.png)" in text
    assert "(plots/bench_cpu_acceptance.png)" in text
    assert "commit abc1234" in text and "Command: `jaxspec bench --peers hf,hf-assisted`" in text
    # magicdec rows table and its speedup plot
    assert "| batch | prefix | draft | gamma | alpha | speedup |" in text
    assert "| 8 | 2048 | self-snapkv | 3 | 0.8 | 1.25 |" in text
    assert "(plots/magicdec_speedup.png)" in text
    assert "| batch | prefix | gamma | predicted_speedup |" in text
    assert "| 32 | 4096 | 3 | 1.4 |" in text and "not shown: `t_v`." in text
    assert "(plots/magicdec_8b_speedup.png)" in text
    # unknown: generic key/value table; front matter fills only what the JSON lacks
    assert "| `ms_per_token` | 4.125 |" in text and "| `nested.b` | 1, 2 |" in text
    assert "NVIDIA H200 · jax not recorded · commit 9999999" in text
    assert "What it means." in text
    # a notes file without a JSON names the log it stands for
    assert "`results/old_run.log` · not recorded" in text and "The log said 3." in text


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
    assert "## Distilled draft: acceptance and speed" in text
    cpu, h200 = text.split("### cpu")[1].split("### h200")
    assert "CPU (2 cores, x86_64) · jax 0.11.2 · commit 1111111" in cpu
    assert "| chain | distilled | gamma 4 | 40 | 2.75 | 2x | 2/2 |" in cpu
    assert "| chain | distilled | gamma 4 | 1400.0 | 2.75 | 2x | 2/2 |" in h200
    assert "| `draft.stored_bytes` | 4000000 |" in cpu and "| `what` | acceptance" in h200
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
