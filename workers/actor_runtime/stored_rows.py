"""The rows a job stores: its checked engine, its projector, and its blocks batched for projection.

Holds:

- ``build_projector`` — the job's projector of finished rows (dense or a sketch), or None when
  rows are stored whole or projected inside the backward;
- ``checked_engine`` — the job's engine checked against its real model and data (``preflight``),
  its projector and the width of a stored row (``stored_width`` from the engines);
- ``projection_record`` — what the store records about the projection (its ``projection``
  attribute);
- ``stored_blocks`` — the engine's blocks of some classes with the rows to store, projected in
  batches of ``project_rows_for(dim)`` rows (``PROJECT_BYTES``).

Why one module apart from the actor: the actor (``actor.GradientWorker``), the driver's
preparation, ``classgrad estimate``, the footprint model and the query side of ``classgrad score``
all define a stored row through these, so they can never disagree on one; none of them needs Ray.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from classgrad.config import JobConfig
from classgrad.workers.actor_runtime.factory import build_job_engine, preflight
from classgrad.workers.engines import GradientEngine, ProjectedEngine, RowBlock
from classgrad.workers.gradients import finished_projector, projection_options, stored_width
from classgrad.workers.projection import RowProjector

PROJECT_BYTES = 1 << 30


def build_projector(
    config: JobConfig,
    slots=None,
    dim_in: int | None = None,
    *,
    engine: GradientEngine | None = None,
    record: dict | None = None,
) -> RowProjector | None:
    """The job's projector of ``engine``'s finished rows (dense, or a sketch), or None when rows
    are stored whole or projected inside the backward (a ``ProjectedEngine``). ``record``: the
    store's ``projection`` attribute (an unset ``projection.structure`` resumes with it). Without
    ``engine``, the finished rows of ``slots`` (``dim_in`` wide) for a structure that projects
    finished rows; None for one that projects in the backward."""
    options = projection_options(config.projection, record)
    if engine is not None:
        return finished_projector(options, engine)
    if options is None or slots is None or dim_in is None or options.spec.in_backward:
        return None
    return options.finished_projector(slots, dim_in)


def checked_engine(
    config: JobConfig,
    device: str | None = None,
    record: dict | None = None,
) -> tuple[GradientEngine, RowProjector | None, int]:
    """The job's engine, checked against its real model and data (``preflight``), its
    projector (None when rows are stored whole or projected by the engine) and the width of a
    stored row. ``record``: a store's ``projection`` attribute to resume with (see ``build_job_engine``)."""
    engine = build_job_engine(config, device=device, record=record)
    preflight(engine)
    projector = build_projector(config, engine=engine, record=record)
    return engine, projector, stored_width(engine, projector)


def projection_record(engine: GradientEngine, projector: RowProjector | None) -> dict | None:
    """What the store records about the projection (None: full rows)."""
    if isinstance(engine, ProjectedEngine):
        return engine.describe()
    return projector.describe() if projector else None


def project_rows_for(dim: int) -> int:
    """Rows gathered per projection: enough to amortise generating R, at most ~1 GiB of rows
    of ``dim`` float32 values."""
    return max(1, min(256, PROJECT_BYTES // (4 * dim)))


def stored_blocks(
    engine: GradientEngine, projector: RowProjector | None, classes: list[int], project_rows: int
) -> Iterator[tuple[RowBlock, torch.Tensor | None]]:
    """Engine blocks of ``classes`` with the rows to store: projected when the job projects.

    Generating R costs about as much as applying it to a few dozen rows (a sketch's buckets,
    when too many to keep, cost several times the sketch itself), so blocks are gathered up to
    ``project_rows`` rows before each projection (bounded by a byte budget).
    What a worker stores, and what ``classgrad estimate`` times.
    """
    if projector is None:
        for block in engine.iter_blocks(classes):
            yield block, None
        return
    pending: list[RowBlock] = []
    gathered = 0
    for block in engine.iter_blocks(classes):
        pending.append(block)
        gathered += len(block)
        if gathered >= project_rows:
            yield _projected(projector, pending)
            pending, gathered = [], 0
    if pending:
        yield _projected(projector, pending)


def _projected(projector: RowProjector, blocks: list[RowBlock]) -> tuple[RowBlock, torch.Tensor]:
    merged = RowBlock.concat(blocks)
    return merged, projector.project(merged.rows)  # project() takes any float dtype
