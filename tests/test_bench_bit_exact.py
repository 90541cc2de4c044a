"""bench_bit_exact's --merge: the rows of several processes and calls (other models, other
commits) in one results file, each row keeping where it was measured."""

import json

from benchmarks.bench_bit_exact import merged


def _part(tmp_path, name, commit, date, model, runs, batch, commands=None, device="NVIDIA H200 x1"):
    payload = {
        "date": date, "device": device, "jax": "0.11.2", "commit": commit,
        "command": f"python benchmarks/bench_bit_exact.py --model {model} ({name})",
        "rows": [
            {"method": m, "draft": d, "batch": batch, "model": model, "parted_rows": 0}
            for m, d in runs
        ],
    }  # fmt: skip
    if commands:
        payload["commands"] = commands
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(payload))
    return str(path)


def test_merge_keeps_each_rows_commit_and_date_and_orders_the_rows(tmp_path):
    a = _part(tmp_path, "a", "aaa", "2026-12-03", "1b", [("tree", "model"), ("chain", "ngram")], 16,
              commands=["call 1", "call 2"])  # fmt: skip
    b = _part(tmp_path, "b", "bbb", "2026-12-04", "1b", [("chain", "model")], 1)
    c = _part(tmp_path, "c", "bbb", "2026-12-04", "smollm2", [("chain", "ngram")], 16)
    out = merged([b, c, a])
    keys = [(r["model"], r["batch"], r["method"], r["draft"], r["commit"]) for r in out["rows"]]
    assert keys == [
        ("1b", 16, "chain", "ngram", "aaa"),  # batch 16 first, then RUNS order
        ("1b", 16, "tree", "model", "aaa"),
        ("1b", 1, "chain", "model", "bbb"),
        ("smollm2", 16, "chain", "ngram", "bbb"),
    ]
    assert [r["date"] for r in out["rows"]] == ["2026-12-03"] * 2 + ["2026-12-04"] * 2
    assert out["commit"] == "per row" and out["model"] == ["1b", "smollm2"]
    assert out["date"] == "2026-12-04" and out["processes"] == 4
    assert "call 1" in out["commands"] and any("(b)" in c for c in out["commands"])
    one = merged([b])
    assert one["commit"] == "bbb" and one["model"] == "1b"


def test_merge_keeps_the_later_measurement_of_a_row(tmp_path):
    old = _part(
        tmp_path, "old", "aaa", "2026-12-03", "1b", [("chain", "ngram"), ("tree", "model")], 1
    )
    new = _part(tmp_path, "new", "bbb", "2026-12-04", "1b", [("chain", "ngram")], 1)
    out = merged([old, new])
    keys = [(r["method"], r["draft"], r["commit"]) for r in out["rows"]]
    assert keys == [("chain", "ngram", "bbb"), ("tree", "model", "aaa")]


def test_merge_keeps_each_rows_device(tmp_path):
    h200 = _part(tmp_path, "h200", "aaa", "2026-12-03", "1b", [("chain", "ngram")], 16)
    h100 = _part(tmp_path, "h100", "bbb", "2026-12-05", "1b", [("chain", "model")], 1,
                 device="NVIDIA H100 80GB HBM3 x1")  # fmt: skip
    out = merged([h200, h100])
    assert [r["device"] for r in out["rows"]] == ["NVIDIA H200 x1", "NVIDIA H100 80GB HBM3 x1"]
    assert out["device"] == "per row: NVIDIA H100 80GB HBM3 x1, NVIDIA H200 x1"
    assert merged([h200])["device"] == "NVIDIA H200 x1"
