"""Cost-model measurements kept across processes (``measure.profiles``): what one process
measured, a later one reads back as the same dataclass; another description, a folder that
cannot be written or a file of another layout leave it to measure again."""

import pytest

from jaxspec.measure import profiles
from jaxspec.measure.cost_model import Measurement, TreeMeasurement
from tests import tiny

DESCRIPTION = {"kind": "magicdec-chain", "batch": 1, "prefix_bucket": 64, "gammas": [1, 2, 4]}
CHAIN = Measurement(
    1, 64, 40.3, 9.5, {1: 40.3, 2: 45.1, 4: 56.1}, 0.7, 2, 2.2, 2.0, interpolated=(2,),
    loop_compile_s=7.5,
)  # fmt: skip
TREE = TreeMeasurement(4, 8, 4, 8, 11.0, 60.0, 3.1, 2.9)


@pytest.fixture(scope="module")
def model():
    return tiny.model(0)


def _owner(model):
    """The model as a new process sees it: nothing kept in memory."""
    model._cache.clear()
    return model


def test_a_later_process_reads_what_an_earlier_one_measured(model, tmp_path):
    for m, kind in ((CHAIN, "magicdec-chain"), (TREE, "magicdec-tree")):
        described = {**DESCRIPTION, "kind": kind}
        profiles.keep(_owner(model), "key", tmp_path, described, m)
        later = _owner(model)
        assert profiles.kept(later, "key", tmp_path, described, type(m)) == m
        assert later._cache["key"] == m  # and kept with the model from then on
    assert sorted(p.name.split("-")[1] for p in tmp_path.iterdir()) == ["chain", "tree"]


def test_another_configuration_or_no_folder_measures_again(model, tmp_path):
    profiles.keep(_owner(model), "key", tmp_path, DESCRIPTION, CHAIN)
    other = {**DESCRIPTION, "batch": 2}
    assert profiles.kept(_owner(model), "key", tmp_path, other, Measurement) is None
    assert profiles.kept(_owner(model), "key", None, DESCRIPTION, Measurement) is None


def test_an_unwritable_folder_or_a_stale_file_is_no_error(model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert profiles.save(blocker / "profiles", DESCRIPTION, {"a": 1}) is None
    profiles.save(tmp_path, DESCRIPTION, {"t_t": 1.0})  # another layout of Measurement
    assert profiles.kept(_owner(model), "key", tmp_path, DESCRIPTION, Measurement) is None
    (path,) = tmp_path.glob("magicdec-chain-*.json")
    path.write_text("{not json")
    assert profiles.load(tmp_path, DESCRIPTION) is None
