"""``classgrad estimate``: what a job will cost, from its config and a short measured run.

Holds ``Estimate`` and ``estimate_job``: the store's size and the peak memory of one actor and of
the driver from the model that the resource preflight of ``classgrad run`` checks
(``footprint``: one code path, the same preflight run here, so a job ``run`` would refuse is
refused here too, before anything is measured), beside the peak memory this process reached; and
the rows/s of one actor, measured by running the job's own engine (and projection, batched as
a worker batches it: ``classgrad.workers.actor_runtime.stored_rows.stored_blocks``) on a sample of
classes spread over the whole range, after a short warm-up that absorbs one-off
costs (tracing, block-size measurement), with the actor's torch thread count
(``cluster.num_cpus_per_worker``).

Start-up is estimated apart and added to the job's wall time: building the engine here (model,
probe set, engine: what each actor does when it starts) is timed, plus ``RAY_STARTUP_ALLOWANCE_S``
for starting Ray and the actor processes.

Actors share cores: the job's rate is per-actor rows/s x min(num_workers, cores /
num_cpus_per_worker), where cores is ``os.cpu_count()`` for a job that starts a local Ray; on a
cluster each actor is assumed to get the CPUs it reserves (cores unknown here: no sharing).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from classgrad.config import JobConfig
from classgrad.service.driver_runtime.footprint import BuildMeter, Part, parts_text
from classgrad.units import fmt_mib
from classgrad.workers.actor_runtime.stored_rows import checked_engine, project_rows_for, stored_blocks

# Starting a local Ray and one actor process until it answers a call (its imports included, the
# engine build excluded: that is timed per job). Measured once, 2026-12-01, on the shared 2-core
# dev machine (other test runs going) with `.venv/bin/python -m benchmarks.ray_startup --repeats 2`:
# 8.5 s the first time (cold caches, as a fresh job meets them), 3.7 s the second; the cold one is used.
RAY_STARTUP_ALLOWANCE_S = 8.5


@dataclass
class Estimate:
    num_classes: int
    dim: int
    store_dtype: str
    store_bytes: int  # exact: grads, row_scale, loss and count (footprint)
    store_disk_bytes: int  # the same in whole chunks, uncompressed
    engine: str
    device: str
    sample_rows: int
    sample_seconds: float
    rows_per_s_per_actor: float
    peak_memory_bytes: int  # the model's (footprint): one actor's peak RSS on a CPU, its GPU memory on a GPU
    memory_kind: str  # "peak RSS" on CPU, "peak CUDA memory" on a GPU
    measured_peak_memory_bytes: int  # what this process reached measuring (same kind)
    driver_memory_bytes: int  # the model's peak RSS of the driver
    num_workers: int
    num_cpus_per_worker: int
    cores: int | None  # cores the actors share (os.cpu_count() for a local Ray); None: a cluster's, unknown
    actors_in_parallel: float  # min(num_workers, cores / num_cpus_per_worker): actors' worth of cores
    rows_per_s_job: float
    job_seconds: float  # compute alone
    engine_build_seconds: float  # measured: model, probe set and engine, as each actor builds them
    ray_startup_seconds: float  # RAY_STARTUP_ALLOWANCE_S: Ray and actor processes
    startup_seconds: float  # engine_build_seconds + ray_startup_seconds
    wall_seconds: float  # startup_seconds + job_seconds
    footprint: dict  # Footprint.to_dict(): every part, with the key that changes it
    preflight_notes: list[str]  # clamps and warnings near a limit, as run would say them

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        return [
            f"store      {self.num_classes} x {self.dim} {self.store_dtype} = {fmt_mib(self.store_bytes)} "
            f"({fmt_mib(self.store_disk_bytes)} in whole chunks)",
            f"engine     {self.engine} on {self.device}: {self.sample_rows} sample rows in "
            f"{self.sample_seconds:.2f} s (after a warm-up)",
            f"per actor  {self.rows_per_s_per_actor:,.1f} rows/s, "
            f"{self.memory_kind} ~{fmt_mib(self.peak_memory_bytes)} (the preflight's model; "
            f"{fmt_mib(self.measured_peak_memory_bytes)} reached here)",
            f"memory     {parts_text([Part(**p) for p in self.footprint['actor']])}",
            f"driver     peak RSS ~{fmt_mib(self.driver_memory_bytes)}",
            *(f"preflight  {n.removeprefix('preflight: ')}" for n in self.preflight_notes),
            f"cores      {sharing_line(self.num_workers, self.num_cpus_per_worker, self.cores)}",
            f"job        {self.num_workers} actors: ~{self.rows_per_s_job:,.1f} rows/s "
            f"(per actor x {self.actors_in_parallel:g}), ~{self.job_seconds:,.0f} s for {self.num_classes} rows",
            f"start-up   ~{self.startup_seconds:,.1f} s: engine build {self.engine_build_seconds:.1f} s (measured) "
            f"+ Ray and actor processes {self.ray_startup_seconds:.1f} s (allowance)",
            f"wall time  ~{self.wall_seconds:,.0f} s (start-up + compute)",
        ]


def actors_in_parallel(num_workers: int, num_cpus_per_worker: int, cores: int | None) -> float:
    """Actors' worth of cores the job gets: min(num_workers, cores / num_cpus_per_worker); all
    actors when cores is unknown (a cluster, where each actor holds the CPUs it reserves)."""
    if cores is None:
        return float(num_workers)
    return min(float(num_workers), cores / num_cpus_per_worker)


def sharing_line(num_workers: int, num_cpus_per_worker: int, cores: int | None) -> str:
    """The core-sharing rule as applied, in words."""
    if cores is None:
        return f"{num_workers} x {num_cpus_per_worker} CPU on a cluster: each actor on its own reserved CPUs"
    need = num_workers * num_cpus_per_worker
    rule = "rate = per actor x min(num_workers, cores / num_cpus_per_worker)"
    if need > cores:
        return f"{num_workers} x {num_cpus_per_worker} CPU on {cores} cores: actors share cores; {rule}"
    return f"{num_workers} x {num_cpus_per_worker} CPU on {cores} cores: no sharing; {rule}"


def local_cores(config: JobConfig) -> int | None:
    """Cores of the machine a job's actors share: this one's when the job starts a local Ray,
    None (unknown here) when it joins a cluster."""
    from classgrad.service.driver_runtime.ray_session import resolve_ray_address

    if resolve_ray_address(config.cluster.address)[0] is not None:
        return None
    return os.cpu_count() or 1


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def estimate_job(
    config: JobConfig, sample_rows: int | None = None, device: str | None = None, *, preflight: bool = True
) -> Estimate:
    """``preflight``: False skips the checks against this node (the figures are reported either way)."""
    import torch

    # Measure as an actor runs: with its thread count (GradientWorker sets it before building).
    threads = torch.get_num_threads()
    torch.set_num_threads(config.cluster.num_cpus_per_worker)
    try:
        return _measure(config, sample_rows, device, preflight)
    finally:
        torch.set_num_threads(threads)


def _measure(config: JobConfig, sample_rows: int | None, device: str | None, preflight: bool) -> Estimate:
    import torch

    from classgrad.service.driver_runtime.preflight import preflight_job

    t_build = time.perf_counter()
    meter = BuildMeter.started()
    engine, projector, dim = checked_engine(config, device=device)
    build_seconds = time.perf_counter() - t_build
    footprint, notes = preflight_job(
        config, engine, projector, dim, build_bytes=meter.stop(), check=preflight, device=str(engine.device)
    )
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
        peak, kind, model = torch.cuda.max_memory_allocated(engine.device), "peak CUDA memory", footprint.device_bytes
    else:
        peak, kind, model = _peak_rss_bytes(), "peak RSS", footprint.actor_bytes
    rate = len(sample) / seconds if seconds > 0 else float("inf")
    cluster = config.cluster
    cores = local_cores(config)
    parallel = actors_in_parallel(cluster.num_workers, cluster.num_cpus_per_worker, cores)
    job_seconds = C / (rate * parallel)
    startup = build_seconds + RAY_STARTUP_ALLOWANCE_S
    return Estimate(
        num_classes=C,
        dim=dim,
        store_dtype=config.store.dtype,
        store_bytes=footprint.store_bytes,
        store_disk_bytes=footprint.store_disk_bytes,
        engine=engine.name,
        device=str(engine.device),
        sample_rows=len(sample),
        sample_seconds=seconds,
        rows_per_s_per_actor=rate,
        peak_memory_bytes=model,
        memory_kind=kind,
        measured_peak_memory_bytes=int(peak),
        driver_memory_bytes=footprint.driver_bytes,
        num_workers=cluster.num_workers,
        num_cpus_per_worker=cluster.num_cpus_per_worker,
        cores=cores,
        actors_in_parallel=parallel,
        rows_per_s_job=rate * parallel,
        job_seconds=job_seconds,
        engine_build_seconds=build_seconds,
        ray_startup_seconds=RAY_STARTUP_ALLOWANCE_S,
        startup_seconds=startup,
        wall_seconds=startup + job_seconds,
        footprint=footprint.to_dict(),
        preflight_notes=notes,
    )
