"""The resource preflight: a job that cannot fit is refused before its store exists or an actor starts.

Holds ``Limits`` (what the job may use: this node's available and total memory and CPUs, one local
GPU's memory, the free space where a local store goes; ``node_limits`` reads them), ``check_sizes``
(sizes refused where they are read: ``projection.dim`` larger than the row, for every structure),
``check_resources`` (the job's ``Footprint`` against the limits: a ``ResourceError`` naming the
numbers and the key to change when it cannot fit, one warning near the limit), ``preflight_job``
(all of it, from the engine the driver builds to check the job: what ``check_job`` and
``classgrad estimate`` call) and ``NEAR``.

What is checked, from the ``Footprint`` that ``classgrad estimate`` reports too:

- a local Ray (every actor on this node): the driver and ``cluster.num_workers`` actors against this
  node's available memory;
- a cluster (``cluster.address``, or inside a Ray job): one actor against this node's total memory,
  and the actors that fit on a node of its CPUs (``cores / cluster.num_cpus_per_worker``) together;
  nodes of another size are the reason for ``--no-preflight``;
- a GPU job on a local GPU: one actor's device memory against its share of the GPU
  (``cluster.num_gpus_per_worker`` of it, at most one GPU);
- a local store: its size in whole chunks, less what an existing store there already holds,
  against the filesystem's free space.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from classgrad.config import JobConfig
from classgrad.errors import ResourceError
from classgrad.service.driver_runtime.footprint import Footprint, Part, mb
from classgrad.store import local_path
from classgrad.units import fmt_bytes
from classgrad.workers.projection import check_width

log = logging.getLogger(__name__)

NEAR = 0.8  # a job above this share of a limit gets one warning
NO_PREFLIGHT = "--no-preflight where the actors' nodes differ from this one"

# What to do about a part, by its key.
_ADVICE = {
    "data.batch_size": "lower data.batch_size",
    "engine.group_rows": "lower engine.group_rows",
    "engine.block_rows": "lower engine.block_rows",
    "projection.dim": "lower projection.dim",
    "projection.sketch_nonzeros": "lower projection.sketch_nonzeros",
    "params.include": "select fewer parameters (params.include / params.exclude)",
    "model.factory": "use a smaller model (model.factory)",
    "data.kwargs": "use a smaller probe set (data.kwargs)",
    "store.row_chunk": "lower store.row_chunk",
    "cluster.num_workers": "lower cluster.num_workers",
    "cluster.num_cpus_per_worker": "raise cluster.num_cpus_per_worker (fewer actors per node)",
    "cluster.num_gpus_per_worker": "raise cluster.num_gpus_per_worker (fewer actors per GPU)",
    "store.url": "put store.url on a filesystem with more space",
}


@dataclass(frozen=True)
class Limits:
    """What a job may use, as seen from the driver's node."""

    memory_available: int  # bytes
    memory_total: int
    cpus: int
    local_ray: bool  # the job starts a local Ray: every actor runs on this node
    gpu_memory: int | None = None  # bytes of one GPU here, when the job's actors use this node's GPUs
    disk_free: int | None = None  # bytes free where the (local) store goes; None: not a local store
    store_held: int = 0  # bytes an existing store at store.url already holds


def node_limits(config: JobConfig) -> Limits:
    """This node's limits for ``config``'s job."""
    import psutil

    from classgrad.service.driver_runtime.footprint import starts_local_ray

    vm = psutil.virtual_memory()
    local_ray = starts_local_ray(config)
    gpu = None
    if local_ray and config.resolved_device().startswith("cuda"):
        gpu = _gpu_memory(config.resolved_device())
    disk, held = _disk(config.store.url)
    return Limits(
        memory_available=int(vm.available),
        memory_total=int(vm.total),
        cpus=os.cpu_count() or 1,
        local_ray=local_ray,
        gpu_memory=gpu,
        disk_free=disk,
        store_held=held,
    )


def _gpu_memory(device: str) -> int | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    except Exception:  # noqa: BLE001 - no usable GPU here: the device check says so
        return None


def _disk(url: str) -> tuple[int | None, int]:
    """(free bytes on the filesystem a local store goes to, bytes a store there already holds)."""
    path = local_path(url)
    if path is None:
        return None, 0
    target = Path(path).expanduser().absolute()
    held = _tree_bytes(target) if target.is_dir() else 0
    probe = target
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        if os.statvfs(probe).f_flag & os.ST_RDONLY:
            return None, held  # nothing to judge: creating the store says "read-only" itself
        return int(shutil.disk_usage(probe).free), held
    except OSError:
        return None, held


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def check_sizes(config: JobConfig, row_width: int) -> None:
    """Refuse a ``projection.dim`` larger than the row it projects, whatever the structure."""
    if config.projection.dim is not None:
        check_width(config.projection.dim, row_width)


def _largest(parts: list[Part]) -> Part:
    keyed = [p for p in parts if p.key is not None] or parts
    return max(keyed, key=lambda p: p.bytes)


def _advice(key: str | None) -> str:
    return _ADVICE.get(key or "", f"change {key}") if key else "use a larger node"


def _refuse(what: str, need: int, parts: list[Part], limit_text: str, key: str | None, tail: str = "") -> None:
    shown = ", ".join(f"{p.name} {mb(p.bytes)}" for p in sorted(parts, key=lambda p: -p.bytes)[:3] if p.bytes >= 1e6)
    raise ResourceError(f"preflight: {what} needs ~{mb(need)} ({shown}) but {limit_text}: {_advice(key)}{tail}")


def check_resources(config: JobConfig, footprint: Footprint, limits: Limits) -> list[str]:
    """Refuse (``ResourceError``, one line) a job that cannot fit ``limits``; return the warnings
    of a job near them (each also logged once)."""
    warnings: list[str] = []
    cluster = config.cluster
    # The driver starts no more actors than there are shards.
    workers = min(cluster.num_workers, -(-footprint.num_classes // config.sharding.shard_rows))
    actor, driver = footprint.actor_bytes, footprint.driver_bytes
    biggest = _largest(footprint.actor)
    # The GPU first: on a GPU the rows and activations live there.
    if footprint.device_parts and limits.gpu_memory:
        share = int(limits.gpu_memory * min(1.0, cluster.num_gpus_per_worker or 1.0))
        need = footprint.device_bytes
        if need > share:
            fits_whole = need <= limits.gpu_memory and cluster.num_gpus_per_worker < 1
            key = "cluster.num_gpus_per_worker" if fits_whole else _largest(footprint.device_parts).key
            _refuse(
                "each actor's GPU memory",
                need,
                footprint.device_parts,
                f"its share of the GPU is {mb(share)} ({cluster.num_gpus_per_worker:g} of {mb(limits.gpu_memory)})",
                key,
            )
        warnings += _near("each actor's GPU memory", need, share, "cluster.num_gpus_per_worker", "its share of the GPU")
    if limits.local_ray:
        avail = limits.memory_available
        if actor + driver > avail:
            _refuse(
                "one actor (with the driver)",
                actor + driver,
                footprint.actor,
                f"this node has {mb(avail)} available",
                biggest.key,
            )
        total = workers * actor + driver
        if total > avail:
            fit = max(1, (avail - driver) // max(1, actor))
            raise ResourceError(
                f"preflight: {workers} actors of ~{mb(actor)} each and the driver (~{mb(driver)}) need "
                f"~{mb(total)} but this node has {mb(avail)} available: lower cluster.num_workers (at most {fit} "
                f"fit), or {_advice(biggest.key)}"
            )
        warnings += _near(
            f"{workers} actors and the driver", total, avail, "cluster.num_workers", "this node's available memory"
        )
    else:
        if driver > limits.memory_available:  # the driver alone, here; the actors on the cluster's nodes
            _refuse(
                "the driver",
                driver,
                footprint.driver,
                f"this node has {mb(limits.memory_available)} available",
                _largest(footprint.driver).key,
            )
        node = limits.memory_total
        if actor > node:
            _refuse(
                "each actor", actor, footprint.actor, f"this node has {mb(node)}", biggest.key, f" (or {NO_PREFLIGHT})"
            )
        per_node = min(workers, max(1, limits.cpus // cluster.num_cpus_per_worker))
        if per_node * actor > node:
            raise ResourceError(
                f"preflight: {per_node} actors of ~{mb(actor)} fit on a node of {limits.cpus} CPUs "
                f"(cluster.num_cpus_per_worker={cluster.num_cpus_per_worker}) and need ~{mb(per_node * actor)} but "
                f"this node has {mb(node)}: {_advice('cluster.num_cpus_per_worker')}, or {_advice(biggest.key)} "
                f"(or {NO_PREFLIGHT})"
            )
        warnings += _near(
            f"{per_node} actors on a node", per_node * actor, node, "cluster.num_cpus_per_worker", "this node's memory"
        )
    if limits.disk_free is not None:
        need = max(0, footprint.store_disk_bytes - limits.store_held)
        key = "projection.dim" if footprint.dim > 1 and config.projection.dim is not None else "store.url"
        if need > limits.disk_free:
            raise ResourceError(
                f"preflight: the store ({footprint.num_classes} x {footprint.dim} {footprint.store_dtype}) needs "
                f"~{fmt_bytes(need)} more on disk but {config.store.url}'s filesystem has "
                f"{fmt_bytes(limits.disk_free)} free: "
                f"{_advice('store.url')}, or a smaller store (store.dtype, projection.dim)"
            )
        warnings += _near("the store", need, limits.disk_free, key, "the free disk")
    for line in warnings:
        log.warning(line)
    return warnings


def _near(what: str, need: int, limit: int, key: str, what_of: str) -> list[str]:
    if limit <= 0 or need <= NEAR * limit:
        return []
    return [
        f"preflight: {what} need ~{mb(need)}, {need / limit:.0%} of {what_of} ({mb(limit)}); {_advice(key)} for room"
    ]


def preflight_job(
    config: JobConfig,
    engine: Any,
    projector: Any,
    dim: int,
    *,
    build_bytes: int | None = None,
    check: bool = True,
    limits: Limits | None = None,
    device: str | None = None,
) -> tuple[Footprint, list[str]]:
    """Sizes refused where they are read (``check_sizes``), the job's footprint, and (``check``)
    the footprint against this node's limits (``node_limits``, unless ``limits`` is given): the
    footprint and the notes and warnings a run says (each logged once here). ``device``: where the
    actors compute (default: the job's device)."""
    from classgrad.service.driver_runtime.footprint import job_footprint

    check_sizes(config, getattr(engine, "full_layout", engine.layout).dim)  # a projecting engine's whole row
    notes = []
    samples = len(engine.probe)
    if config.data.batch_size > samples and "batch_size" in config.data.model_fields_set:  # asked for, not the default
        notes.append(
            f"data.batch_size {config.data.batch_size} is more than the probe set's {samples} samples: "
            f"batches of {samples}"
        )
        log.warning(notes[-1])
    footprint = job_footprint(config, engine, projector, dim, build_bytes=build_bytes, device=device)
    if check:
        notes += check_resources(config, footprint, limits or node_limits(config))
    return footprint, notes
