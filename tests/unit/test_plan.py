"""Unit tests of service/plan.py: shards cover every row once, on chunk boundaries, and are
handed out largest-work-first."""

from __future__ import annotations

import numpy as np
import pytest

from classgrad.service.driver_runtime.plan import Shard, dispatch_order, plan_shards


def _by_index(shards: list[Shard]) -> list[Shard]:
    return sorted(shards, key=lambda s: s.index)


@pytest.mark.parametrize(
    ("num_rows", "shard_rows", "row_chunk"),
    [(1, 16, 16), (16, 16, 16), (100, 32, 16), (10_000, 256, 16), (257, 256, 1), (48, 48, 16)],
)
def test_cover_every_row_once_on_chunk_boundaries(num_rows: int, shard_rows: int, row_chunk: int) -> None:
    shards = plan_shards(num_rows, shard_rows, row_chunk)
    ordered = _by_index(shards)
    assert [s.index for s in ordered] == list(range(len(shards)))
    # Consecutive, no gap, no overlap, exactly [0, num_rows).
    assert ordered[0].start == 0 and ordered[-1].stop == num_rows
    for prev, nxt in zip(ordered, ordered[1:]):
        assert prev.stop == nxt.start
    covered = np.zeros(num_rows, dtype=int)
    for s in shards:
        covered[s.start : s.stop] += 1
        # Every shard starts on a chunk boundary, and all but the last end on one, so no two
        # shards share a chunk.
        assert s.start % row_chunk == 0
        assert s.stop % row_chunk == 0 or s.stop == num_rows
        assert 0 < s.rows <= shard_rows
    assert np.all(covered == 1)
    assert len(shards) == -(-num_rows // shard_rows)


def test_short_last_shard() -> None:
    ordered = _by_index(plan_shards(100, 32, 16))
    assert [(s.start, s.stop) for s in ordered] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert [s.work for s in ordered] == [32.0, 32.0, 32.0, 4.0]


def test_default_work_is_row_count_and_ties_go_by_index() -> None:
    shards = plan_shards(100, 32, 16)
    # Equal full shards keep row order; the short last one comes last.
    assert [s.index for s in shards] == [0, 1, 2, 3]


def test_largest_work_first_with_uneven_work() -> None:
    work = np.ones(64)
    work[48:64] = 10.0  # shard 3 is expensive
    work[16:32] = 5.0  # shard 1 next
    work[0:16] = 0.0  # shard 0 is empty (e.g. classes without probe samples)
    shards = plan_shards(64, 16, 16, work_per_row=work)
    assert [s.index for s in shards] == [3, 1, 2, 0]
    assert [s.work for s in shards] == [160.0, 80.0, 16.0, 0.0]
    assert sum(s.work for s in shards) == pytest.approx(work.sum())


def test_work_accepts_a_plain_sequence() -> None:
    shards = plan_shards(4, 2, 1, work_per_row=[1, 1, 3, 0])
    assert [(s.index, s.work) for s in shards] == [(1, 3.0), (0, 2.0)]


def test_zero_rows_gives_no_shards() -> None:
    assert plan_shards(0, 16, 16) == []


def test_dispatch_order_skips_done_shards() -> None:
    shards = plan_shards(64, 16, 16, work_per_row=np.arange(64, dtype=float)[::-1])
    assert [s.index for s in shards] == [0, 1, 2, 3]
    done = [True, False, True, False]
    assert [s.index for s in dispatch_order(shards, done)] == [1, 3]
    # The store's shard_done array is uint8; any order of the input list gives the same result.
    assert dispatch_order(list(reversed(shards)), np.array(done, dtype=np.uint8)) == [
        shards[1],
        shards[3],
    ]
    assert dispatch_order(shards, [True] * 4) == []
    assert dispatch_order(shards, [False] * 4) == shards


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((100, 20, 16), {}, "multiple of row_chunk"),
        ((100, 0, 16), {}, "must be > 0"),
        ((100, 16, 0), {}, "must be > 0"),
        ((-1, 16, 16), {}, "num_rows must be >= 0"),
        ((100, 16.0, 16), {}, "shard_rows must be an integer"),
        ((100, True, 1), {}, "shard_rows must be an integer"),
        ((10, 16, 16), {"work_per_row": [1.0] * 9}, "one value per row"),
        ((2, 16, 16), {"work_per_row": [1.0, np.nan]}, "finite and >= 0"),
        ((2, 16, 16), {"work_per_row": [1.0, -1.0]}, "finite and >= 0"),
    ],
)
def test_invalid_arguments(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_shards(*args, **kwargs)


def test_dispatch_order_needs_a_flag_per_shard() -> None:
    shards = plan_shards(64, 16, 16)
    with pytest.raises(ValueError, match="one flag per shard"):
        dispatch_order(shards, [False, False])
    with pytest.raises(ValueError, match="one flag per shard"):
        dispatch_order(shards, [[False] * 4])


def test_shard_is_immutable() -> None:
    shard = plan_shards(16, 16, 16)[0]
    assert shard == Shard(index=0, start=0, stop=16, work=16.0)
    with pytest.raises(AttributeError):
        shard.start = 3  # type: ignore[misc]
