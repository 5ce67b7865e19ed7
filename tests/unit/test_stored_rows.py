"""What a stored row is (``classgrad.workers.actor_runtime.stored_rows``): rows are gathered
before each projection, up to a byte budget."""

from __future__ import annotations

import torch

from classgrad.workers.actor_runtime.stored_rows import project_rows_for, stored_blocks
from classgrad.workers.engines import RowBlock
from classgrad.workers.projection import Projector


def test_rows_per_projection_fit_the_byte_budget():
    assert project_rows_for(1000) == 256  # small rows: capped at 256
    assert project_rows_for(1 << 22) == 64  # 64 rows of 4 Mi float32 values = 1 GiB
    assert project_rows_for(1 << 30) == 1  # never fewer than one


class TwoRowBlocks:
    """Stands in for an engine: rows of any class list in blocks of two."""

    def iter_blocks(self, classes):
        for i in range(0, len(classes), 2):
            ids = torch.tensor(classes[i : i + 2])
            n = len(ids)
            yield RowBlock(
                ids,
                torch.randn(n, 16, generator=torch.Generator().manual_seed(i)),
                torch.zeros(n),
                torch.ones(n, dtype=torch.long),
                torch.ones(n),
                torch.zeros(n, dtype=torch.bool),
            )


def test_blocks_are_gathered_before_each_projection():
    engine = TwoRowBlocks()
    plain = [(len(b), rows) for b, rows in stored_blocks(engine, None, list(range(5)), 3)]
    assert plain == [(2, None), (2, None), (1, None)]  # unprojected: the engine's blocks as they come
    projector = Projector(16, 4, seed=1)
    got = list(stored_blocks(engine, projector, list(range(6)), 3))
    assert [b.classes.tolist() for b, _ in got] == [[0, 1, 2, 3], [4, 5]]  # 2 + 2 >= 3 rows, then the rest
    for merged, rows in got:
        assert rows.shape == (len(merged), 4)
        assert torch.equal(rows, projector.project(merged.rows))  # the same projection of the same rows
