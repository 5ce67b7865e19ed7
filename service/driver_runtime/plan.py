"""Planning: the classes (rows) of a job cut into shards, and the order they are handed out.

Holds ``Shard`` (a run of consecutive rows, a whole number of store row chunks, with its
expected work), ``plan_shards`` (all shards of a job, largest work first) and
``dispatch_order`` (the shards still to do, largest work first). Pure Python + numpy: the driver
plans before it starts Ray, and tests plan without it.

Why largest-work-first: classes differ in sample count, so shards differ in cost; handing the
expensive ones out first keeps one slow shard from being the last thing every actor waits on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Shard", "dispatch_order", "plan_shards"]


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, stop)``; ``index`` is the shard's position in row order (its stable id,
    the same index as the store's ``shard_done``); ``work`` is its expected cost."""

    index: int
    start: int
    stop: int
    work: float

    @property
    def rows(self) -> int:
        return self.stop - self.start


def _largest_first(shards: Sequence[Shard]) -> list[Shard]:
    # Ties by index keep the order deterministic, so reruns hand out shards the same way.
    return sorted(shards, key=lambda s: (-s.work, s.index))


def plan_shards(
    num_rows: int,
    shard_rows: int,
    row_chunk: int,
    *,
    work_per_row: Sequence[float] | np.ndarray | None = None,
) -> list[Shard]:
    """Cut rows ``[0, num_rows)`` into shards of ``shard_rows`` consecutive rows (the last may be
    shorter), returned in dispatch order: largest ``work`` first, ties by index.

    ``shard_rows`` must be a multiple of ``row_chunk`` so every shard starts on a chunk boundary
    and no two writers ever touch the same chunk. ``work`` is the sum of ``work_per_row`` over
    the shard (e.g. probe samples per class); by default each row costs 1.
    """
    sizes = {"num_rows": num_rows, "shard_rows": shard_rows, "row_chunk": row_chunk}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    if shard_rows <= 0 or row_chunk <= 0:
        raise ValueError(f"shard_rows and row_chunk must be > 0, got {shard_rows} and {row_chunk}")
    if shard_rows % row_chunk:
        raise ValueError(f"shard_rows must be a multiple of row_chunk ({row_chunk}), got {shard_rows}")
    if work_per_row is None:
        work = np.ones(num_rows, dtype=np.float64)
    else:
        work = np.asarray(work_per_row, dtype=np.float64)
        if work.shape != (num_rows,):
            raise ValueError(f"work_per_row must have one value per row ({num_rows}), got shape {work.shape}")
        if not np.all(np.isfinite(work)) or np.any(work < 0):
            raise ValueError("work_per_row must be finite and >= 0")
    shards = [
        Shard(
            index=i,
            start=start,
            stop=min(start + shard_rows, num_rows),
            work=float(work[start : start + shard_rows].sum()),
        )
        for i, start in enumerate(range(0, num_rows, shard_rows))
    ]
    return _largest_first(shards)


def dispatch_order(shards: Sequence[Shard], done: Sequence[bool] | np.ndarray) -> list[Shard]:
    """The shards not yet done (``done[shard.index]`` false), largest work first."""
    flags = np.asarray(done, dtype=bool)
    needed = max((s.index for s in shards), default=-1) + 1
    if flags.ndim != 1 or len(flags) < needed:
        raise ValueError(f"done must hold one flag per shard (at least {needed}), got shape {flags.shape}")
    return _largest_first([s for s in shards if not flags[s.index]])
