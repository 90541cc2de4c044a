"""`jaxspec profile --method magicdec` on a tiny checkpoint: the cost-model table per batch and
prefix, and the chosen shape is the one with the best predicted speedup."""

import re

import pytest

import jaxspec
from jaxspec import cli
from tests import hf_fixtures

TREE = ["--tree", "--depth", "2", "--width", "2", "--branch", "2", "--bs", "3"]


@pytest.mark.parametrize("tree", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_profile_magicdec_prints_the_cost_model_table(tree, tmp_path, capsys):
    src = tmp_path / "hf"
    hf_fixtures.save_hf_checkpoint("llama3.2", src)
    ckpt = jaxspec.convert(src, tmp_path / "m", dtype="float32", progress=False)
    argv = ["profile", "--method", "magicdec", "--model", str(ckpt), "--dtype", "float32"]
    argv += ["--draft", "self-streaming", "--budget", "20", "--batches", "3"]
    argv += ["--prefixes", "40", "--gammas", "1,3", *(TREE if tree else [])]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = ["batch", "prefix", "T_T", "ms", "T_D", "ms", "alpha", "slow", "gamma", "T_V", "ms"]
    assert lines[0].split() == [*head, "speedup"]
    assert lines[1].startswith("(alpha: the mean row's") and lines[2].startswith(" predictions")
    lines = [lines[0], *lines[3:]]
    first = lines[1].split()
    assert first[:2] == ["3", "40"] and first[6] == "1"
    t_t, t_d, alpha, slow = (float(x) for x in first[2:6])
    assert t_t > 0 and t_d > 0 and 0.0 <= slow <= alpha <= 1.0
    assert lines[2].split()[0] == "3"  # the second gamma's row
    assert lines[-1].split()[0] == "chosen:"
    candidates = [float(x) for x in re.findall(r"([\d.]+)x", "\n".join(lines[1:-1]))]
    (best,) = (float(x) for x in re.findall(r"predicted ([\d.]+)x", lines[-1]))
    assert len(candidates) == (3 if tree else 2) and best == max(candidates)
    if "chosen: tree" in out:
        assert tree and candidates[-1] >= max(candidates[:2])
    else:
        assert "chosen: chain" in out and (not tree or candidates[-1] <= max(candidates[:2]))
    assert out.count("tree d2 w2 k2 bs3") == tree


def test_profile_magicdec_user_errors(tmp_path, capsys):
    argv = ["profile", "--method", "magicdec", "--model", str(tmp_path / "none")]
    assert cli.main([*argv, "--draft", "self-streaming"]) == 2
    assert "error:" in capsys.readouterr().err
