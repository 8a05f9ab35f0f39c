"""scripts/bench_server.py's arithmetic: the decode time of concurrent streams is the union of
their first-to-last-token intervals (overlaps counted once, gaps not at all)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_server  # noqa: E402


@pytest.mark.parametrize(
    "spans, want",
    [
        ([], 0.0),
        ([(0.0, 2.0)], 2.0),
        ([(0.0, 2.0), (3.0, 4.0)], 3.0),  # sequential requests: the sum
        ([(0.0, 2.0), (1.0, 3.0)], 3.0),  # overlapping
        ([(1.0, 3.0), (0.0, 5.0), (4.0, 6.0)], 6.0),  # nested, unsorted
        ([(0.0, 1.0), (1.0, 2.0), (5.0, 5.5)], 2.5),  # touching, then a gap
    ],
)
def test_union_of_decode_intervals(spans, want):
    assert bench_server.union_s(spans) == pytest.approx(want)
