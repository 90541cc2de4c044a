"""The trace summary of the GPU benchmarks (benchmarks/trace_gaps.py) on made-up events: busy
time is the union of overlapping kernels, gaps are named by the modules around them."""

from benchmarks import trace_gaps as tg

MS = 1_000_000  # ns


def test_busy_intervals_merge_overlaps():
    ev = [(0, 5, "a"), (3, 4, "b"), (10, 2, "c"), (12, 3, "d"), (20, 1, "e")]
    assert tg.busy_intervals(ev) == [(0, 7), (10, 15), (20, 21)]


def test_summary_names_the_largest_gap():
    modules = [(0, 4 * MS, "jit_draft_grow(1)"), (9 * MS, 2 * MS, "jit_draft_next(7)")]
    kernels = [
        (0, 2 * MS, "k1"),
        (1 * MS, 3 * MS, "k2"),
        (9 * MS, 1 * MS, "k3"),
        (10 * MS, MS, "k4"),
    ]
    s = tg.summarize(modules, kernels)
    assert s["kernels"] == 4
    assert s["span_ms"] == 11.0 and s["busy_ms"] == 6.0 and s["idle_ms"] == 5.0
    assert s["largest_gaps"][0] == {"ms": 5.0, "after": "draft_grow", "before": "draft_next"}
    assert s["modules"] == {
        "draft_grow": {"count": 1, "ms": 4.0},
        "draft_next": {"count": 1, "ms": 2.0},
    }
    assert tg.summarize([], []) == {"kernels": 0}


def test_timeline_orders_both_devices():
    devices = {
        "/device:GPU:0": {"modules": [(2 * MS, 6 * MS, "jit_target_verify(3)")], "kernels": []},
        "/device:GPU:1": {
            "modules": [(0, MS, "jit_draft_next(1)"), (3 * MS, 2 * MS, "jit_draft_grow(2)")],
            "kernels": [],
        },
    }
    assert tg.timeline(devices) == [
        [1, "draft_next", 0.0, 1.0],
        [0, "target_verify", 2.0, 6.0],
        [1, "draft_grow", 3.0, 2.0],
    ]
    assert tg.timeline(devices, skip=1, n=1) == [[0, "target_verify", 0.0, 6.0]]
    assert tg.device_events("/nonexistent-trace-dir") == {}


def test_module_spans_from_tagged_kernels():
    kernels = [
        (5 * MS, MS, "jit_draft_grow"),
        (0, MS, "jit_target_verify"),
        (2 * MS, 2 * MS, "jit_target_verify"),  # same module: one span 0-4 ms
        (7 * MS, MS, "jit_draft_grow"),  # after a gap, still one span 5-8 ms
        (9 * MS, MS, "jit_target_verify"),  # the module again: a new span
    ]
    assert tg.spans_from_kernels(kernels) == [
        (0, 4 * MS, "jit_target_verify"),
        (5 * MS, 3 * MS, "jit_draft_grow"),
        (9 * MS, MS, "jit_target_verify"),
    ]
    assert tg.spans_from_kernels([]) == []
    # two executions of one module, told apart by their run ids
    runs = [(0, MS, "jit_target_verify#1"), (2 * MS, MS, "jit_target_verify#2")]
    assert [s[2] for s in tg.spans_from_kernels(runs)] == [r[2] for r in runs]
    assert tg.short("jit_target_verify#2") == "target_verify"


def test_segments_join_close_kernels_and_split_at_gaps():
    ms = 1_000_000
    kernels = [
        (0, 2 * ms, "gemm"),
        (2 * ms + 5_000, ms, "attn"),  # 5 us after: same segment
        (2 * ms + 10_000, ms // 2, "gemm"),  # overlaps the previous one
        (10 * ms, ms, "sendrecv"),  # a 7 ms gap: a new segment
        (30 * ms, ms, "late"),  # outside the window
    ]
    rows = tg.segments(kernels, 0, 20 * ms)
    assert len(rows) == 2
    start, span, busy, n, top = rows[0]
    assert (start, n, top[0]) == (0.0, 3, "gemm")
    assert (span, busy) == (3.005, 3.0)  # the 5 us between them is idle
    assert rows[1][:4] == [10.0, 1.0, 1.0, 1]
