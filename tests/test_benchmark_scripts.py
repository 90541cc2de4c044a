"""Every benchmark script runs as RESULTS.md writes its command, ``python benchmarks/X.py``, from
any folder: 18 of them imported ``benchmarks.common`` with only their own folder on the path
(which works where PYTHONPATH holds the repository, as on the GPU machines, and nowhere else)."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p.name
    for p in (REPO / "benchmarks").glob("*.py")
    if 'if __name__ == "__main__":' in p.read_text()
)

# One process for all (jax imports once): each script as ``python`` runs a file, its folder first
# on the path and nothing of the repository's imported, then ``--help``.
CHECK = """
import runpy, sys
root, folder, names = sys.argv[1], sys.argv[2], sys.argv[3:]
base = [p for p in sys.path if p not in (root, "", ".")]
failed = []
for name in names:
    sys.path[:] = [folder, *base]
    for mod in [m for m in sys.modules if m.split(".")[0] in ("benchmarks", "tests")]:
        del sys.modules[mod]
    sys.argv = [f"{folder}/{name}", "--help"]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            failed.append(f"{name}: exit {e.code}")
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print("FAILED " + " | ".join(failed) if failed else "ok")
"""


def test_every_benchmark_script_runs_from_another_folder(tmp_path):
    assert len(SCRIPTS) > 20
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run(
        [sys.executable, "-c", CHECK, str(REPO), str(REPO / "benchmarks"), *SCRIPTS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "ok", r.stdout[-3000:]


FAKE_PEER = """
import json, sys, time
rows = sys.argv[1].split(",")
for label in rows:
    print(json.dumps({"label": label, "tok_per_s_whole_call": 900.0}), flush=True)
time.sleep(60)  # HF's static cache compiling, as on the GPU machines
"""


def test_the_small_model_benchmark_stops_the_peer_once_its_rows_are_in(tmp_path, monkeypatch):
    """``bench_small_model.peer`` keeps the peer's CUDA-graph row and HF's eager row and stops
    the peer then, not after the minutes of its last, failing row; a peer that never prints its
    own row gives None at the time limit."""
    import time

    from benchmarks import bench_small_model as bsm

    script = tmp_path / "peer.py"
    script.write_text(FAKE_PEER)
    monkeypatch.setattr(bsm, "default_gguf_path", lambda: "model.gguf")

    def run(rows: str, **kw):
        wrapper = tmp_path / f"run_{len(rows)}.py"  # the peer's argv: real GGUF IDS
        wrapper.write_text(
            f"import runpy, sys\nsys.argv = ['peer.py', {rows!r}]\n"
            f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
        )
        t0 = time.perf_counter()
        got = bsm.peer(str(wrapper), [1, 2, 3], 8, **kw)
        return got, time.perf_counter() - t0

    got, took = run("torch_cudagraph_real_smol_ctx1024,hf_eager_real_smol_ctx1024")
    assert took < 30, "waited for the peer's last row"
    assert got["label"] == "torch_cudagraph_real_smol_ctx1024"
    assert [r["label"] for r in got["others"]] == ["hf_eager_real_smol_ctx1024"]
    got, took = run("hf_eager_real_smol_ctx1024", timeout_s=2)
    assert got is None and took < 30


def test_merging_two_small_model_calls_keeps_each_runs_figures(tmp_path):
    """``--merge``: the second call's 4K context joins the first's 1K one with its own commit and
    command, its float32 check too (it ran last, in the second call); the first call's keep."""
    import json

    from benchmarks import bench_small_model as bsm

    run = {"date": "2026-12-06", "device": "GPU", "model": "m"}
    first = {**run, "commit": "aaa", "command": "one", "ctx1024": {"rows": {}}, "peer": {"x": 1}}
    more = {**run, "commit": "bbb", "command": "two", "ctx1024": {"rows": {"late": 1}}}
    more |= {"ctx4096": {"rows": {}, "first_token_ms": 7.5}, "float32_check": {"tree": True}}
    paths = []
    for name, payload in (("a", first), ("b", more)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(payload))
    got = bsm.merged(*map(str, paths))
    assert got["ctx1024"] == {"rows": {}} and got["peer"] == {"x": 1}
    assert got["ctx4096"]["commit"] == "bbb" and got["first_token_ms_ctx4096"] == 7.5
    assert got["float32_check"] == {"tree": True} and got["float32_check_run"].startswith("bbb")
    first["float32_check"] = {"tree": False}
    paths[0].write_text(json.dumps(first))
    assert bsm.merged(*map(str, paths))["float32_check"] == {"tree": False}


def test_the_small_model_benchmark_counts_the_feature_head_among_its_drafts():
    """``--feature``: its rows enter the best speculative method, the tree-over-chain ratio of
    the same head is kept, and the float32 check loads each draft from its own folder."""
    import argparse

    from benchmarks import bench_small_model as bsm

    rate = {"autoregressive": 1000, "chain_ngram": 2000, "chain_draft": 1500, "tree_draft": 1400}
    rate |= {"chain_feature": 2600, "tree_feature": 2800}
    payload = {"ctx1024": {"rows": {k: {"wall_tok_per_s": v} for k, v in rate.items()}}}
    bsm.summarise(payload, 1024)
    assert payload["best_spec"] == "tree_feature"
    assert payload["best_spec_wall_tok_per_s_b1"] == 2800
    assert payload["tree_over_chain_feature"] == round(2800 / 2600, 3)
    assert payload["tree_over_chain_same_draft"] == round(1400 / 1500, 3)
    args = argparse.Namespace(draft="d", feature="f", draft_vocab=16384, compare_vocab=None)
    drafts = {"ngram": 0, "draft": 0, "draft@full": 0, "feature": 0}
    assert bsm.f32_drafts(drafts, args) == {
        "ngram": "ngram",
        "draft": ("d", 16384),
        "draft@full": ("d", None),
        "feature": ("f", 16384),
    }
    assert {r[0] for r in bsm.RUNS if r[2] == "feature"} == {"chain_feature", "tree_feature"}
    # --trees: a feature: prefix gives the head's shapes, rated against its own chain
    runs = bsm.tree_runs("3x8x4x7,feature:4x8x4x7")
    assert [(r[0], r[2], r[3]["bs"]) for r in runs] == [
        ("tree_draft_3x8x4x7", "draft", 7),
        ("tree_feature_4x8x4x7", "feature", 7),
    ]
    payload["ctx1024"]["rows"]["tree_feature_4x8x4x7"] = {"wall_tok_per_s": 3120}
    bsm.summarise(payload, 1024)
    assert payload["tree_shapes_over_chain_same_feature"] == {"tree_feature_4x8x4x7": 1.2}
    assert payload["best_spec"] == "tree_feature_4x8x4x7"
    assert "tree_shapes_over_chain_same_draft" not in payload
    with pytest.raises(SystemExit, match="prefix"):
        bsm.tree_runs("small:4x8x4x7")


def test_the_round_probe_finds_each_kernels_source_line():
    """``probe_rounds.hlo_sources`` reads the stack tables of an optimized HLO text: each op of a
    compiled ``jaxspec`` function maps to the line that traced it."""
    import inspect

    import jax
    import jax.numpy as jnp

    from benchmarks.probe_rounds import hlo_sources
    from jaxspec import ranking

    text = jax.jit(lambda x: ranking.top_k(x, 3)).lower(jnp.ones((2, 40))).compile().as_text()
    where = set(hlo_sources([text]).values())
    lines, start = inspect.getsourcelines(ranking.top_k)
    own = {f"jaxspec/ranking.py:{n}" for n in range(start, start + len(lines))}
    assert where and any(w.split(" < ")[0] in own for w in where), where


def test_the_gpu_runners_record_the_newest_carried_commit(tmp_path):
    """A warm GPU machine keeps the carried folders of earlier calls: ``env.sh`` takes the
    newest ``.carry*/commit``, not the first by name (a run once recorded a stale commit)."""
    for folder, commit, age in ((".carry1", "stale01", 600), (".carry2", "fresh02", 0)):
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "commit"
        path.write_text(commit + "\n")
        os.utime(path, (path.stat().st_mtime - age,) * 2)
    env = REPO / "benchmarks" / "gpu" / "env.sh"
    got = subprocess.run(
        ["bash", "-c", f'source "{env}" && echo "$JAXSPEC_COMMIT"'],
        cwd=tmp_path,
        env={**os.environ, "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert got.stdout.strip() == "fresh02"
    assert (tmp_path / ".jaxspec_commit").read_text().strip() == "fresh02"
