"""bench/profile_step.py's accounting, on hand-made kernel intervals (no GPU): what the profiles in bench/results
count as a launch's time."""
from __future__ import annotations

from conftest import load_bench_module

ps = load_bench_module("profile_step")


def test_profile_counts_overlapping_pdl_kernels_once():
    """A launch's device time is the union of its kernels' intervals (a PDL kernel that starts early and waits is not
    counted twice); gaps between kernels are not counted."""
    assert ps.interval_union([(0.0, 10.0), (2.0, 12.0), (20.0, 25.0)]) == 17.0
    assert ps.interval_union([(5.0, 6.0), (0.0, 10.0)]) == 10.0
    assert ps.interval_union([]) == 0.0


def test_replay_timeline_splits_the_span_by_launch():
    """A replay's kernels mapped back to launches by their kernel counts; a PDL kernel that starts inside its
    predecessor counts from the predecessor's end; a launch of no kernels takes no time."""
    call = [(0.0, 10.0), (8.0, 15.0), (9.0, 20.0), (22.0, 30.0)]  # launch a: 1 kernel, b: 2 (early start), c: 1
    got = ps.split_by_launch(call, [("a", 1), ("b", 2), ("none", 0), ("c", 1)])
    assert got == [("a", 10.0), ("b", 10.0), ("c", 8.0)]  # (the 2 us gap between b and c is idle)
