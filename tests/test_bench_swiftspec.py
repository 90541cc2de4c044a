"""Helpers of benchmarks/bench_swiftspec_2gpu.py."""

from benchmarks.bench_swiftspec_2gpu import first_difference


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a prefix: where the shorter one ends
