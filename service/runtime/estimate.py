"""``classgrad estimate``: what a job will cost, from its config and a short measured run.

Holds ``Estimate`` and ``estimate_job``: the store's size (from the shapes alone), and the
rows/s and peak memory of one actor, measured by running the job's own engine (and projection,
batched as a worker batches it: ``classgrad.workers.runtime.actor.stored_blocks``) on a sample of classes spread
over the whole range, after a short warm-up that absorbs one-off
costs (tracing, block-size measurement). The job's rate assumes actors scale linearly, which
``benchmarks/end_to_end.py`` checks.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from classgrad.service.config import JobConfig

_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# row_scale + loss (float32) + count (int64) per row.
_PER_ROW_BYTES = 4 + 4 + 8


@dataclass
class Estimate:
    num_classes: int
    dim: int
    store_dtype: str
    store_bytes: int
    engine: str
    device: str
    sample_rows: int
    sample_seconds: float
    rows_per_s_per_actor: float
    peak_memory_bytes: int
    memory_kind: str  # "peak RSS" on CPU, "peak CUDA memory" on a GPU
    num_workers: int
    rows_per_s_job: float
    job_seconds: float

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        mb = 1e-6
        return [
            f"store      {self.num_classes} x {self.dim} {self.store_dtype} = {self.store_bytes * mb:,.1f} MB",
            f"engine     {self.engine} on {self.device}: {self.sample_rows} sample rows in "
            f"{self.sample_seconds:.2f} s (after a warm-up)",
            f"per actor  {self.rows_per_s_per_actor:,.1f} rows/s, "
            f"{self.memory_kind} {self.peak_memory_bytes * mb:,.0f} MB",
            f"job        {self.num_workers} actors: ~{self.rows_per_s_job:,.1f} rows/s, "
            f"~{self.job_seconds:,.0f} s for {self.num_classes} rows (plus start-up)",
        ]


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def estimate_job(config: JobConfig, sample_rows: int | None = None, device: str | None = None) -> Estimate:
    import torch

    from classgrad.workers.runtime.actor import checked_engine, project_rows_for, stored_blocks

    engine, projector, dim = checked_engine(config, device=device)
    project_rows = project_rows_for(engine.layout.dim)
    C = config.loss.num_classes
    n = min(C, sample_rows or max(2 * config.store.row_chunk, 64))
    # Classes spread over the whole range: class sizes (and so partitioned cost) vary along it.
    sample = np.unique(np.linspace(0, C - 1, n).round().astype(int)).tolist()
    warm = sample[: max(1, min(len(sample) // 4, 16))]

    def compute(classes: list[int]) -> None:
        # What a worker computes: engine blocks, gathered up to project_rows and projected.
        for _ in stored_blocks(engine, projector, classes, project_rows):
            pass

    compute(warm)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
    t0 = time.perf_counter()
    compute(sample)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    seconds = time.perf_counter() - t0
    if engine.device.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated(engine.device), "peak CUDA memory"
    else:
        peak, kind = _peak_rss_bytes(), "peak RSS"
    rate = len(sample) / seconds if seconds > 0 else float("inf")
    workers = config.cluster.num_workers
    return Estimate(
        num_classes=C,
        dim=dim,
        store_dtype=config.store.dtype,
        store_bytes=C * dim * _ITEM_BYTES[config.store.dtype] + C * _PER_ROW_BYTES,
        engine=engine.name,
        device=str(engine.device),
        sample_rows=len(sample),
        sample_seconds=seconds,
        rows_per_s_per_actor=rate,
        peak_memory_bytes=int(peak),
        memory_kind=kind,
        num_workers=workers,
        rows_per_s_job=rate * workers,
        job_seconds=C / (rate * workers),
    )
