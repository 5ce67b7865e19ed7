"""The one model of a job's memory and size: what ``classgrad estimate`` reports and the preflight checks.

Holds ``Footprint`` (the store's size, and the peak memory of one actor and of the driver, part by
part, each part with the config key that changes it), ``Part``, ``job_footprint`` (the model, from
the engine the driver builds to check the job), ``BuildMeter`` (how much the driver's own build of
the model, probe set and engine grew its resident memory: each actor builds the same) and
``saved_bytes`` (what autograd keeps for the backward, per probe sample and once per forward,
measured on forwards of a few samples and of half as many).

The parts of one actor's peak resident memory (on a GPU the model, activations and rows are on the
device instead, checked against the GPU's memory):

- ``process``: Python, torch and classgrad's worker modules (``PROCESS_BYTES``), plus Ray's core
  worker in an actor process (``RAY_ACTOR_BYTES``) and a CUDA context (``CUDA_HOST_BYTES``);
- ``model``, ``probe set`` and ``build``: the model, the probe set and the engine as built,
  measured on the driver's own build when it can be (``BuildMeter``), and never below the model's
  parameters and buffers plus the probe set's tensors;
- ``activations``: one forward and backward: the samples of a micro-batch (``data.batch_size``, at
  most the probe set; for the partitioned engine at most the samples of a group's largest classes)
  x the bytes autograd saves per sample, plus what it saves once a forward (autocast's copies of
  the weights), x ``ACTIVATION_FACTOR``;
- ``rows``, ``parameter gradients``, ``spot check``: the engine's group of rows (``[group, D]``
  float32, the engines' own group sizes; up to ``WRITER_RUNS`` more groups while the writer holds
  them as views), each parameter's gradients of a group before they are written into it, and the
  partitioned engine's once-per-model check (three rows);
- ``gathered rows``, ``projected rows``, ``projection matrix block`` / ``sketch indices``: finished
  rows gathered before a projection (``project_rows_for``) with their merged copy, the projected
  rows and the projector's own buffers;
- ``writer``: the row writer's runs of whole row chunks in the stored dtype (at most
  ``WRITER_RUNS`` at once; none when they are views of the rows) and one whole chunk of ``grads``.

Each allowance and factor below says where it was measured; ``tests/unit/test_preflight.py``
checks the whole against measured peaks (within 1.5x).

The driver's peak: the process, its build (it builds the job once to check it) and, when it starts
a local Ray, Ray's own processes (``RAY_NODE_BYTES``).

The store's size is exact: ``grads`` (C x dim in the stored dtype) and the per-row arrays
``row_scale``, ``loss`` (float32) and ``count`` (int64); on disk, uncompressed, edge chunks are
written whole, each chunk with its crc32c (``store_disk_bytes``).
What the run history keeps of it and the run summary says is ``run_record``'s.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from classgrad.config import JobConfig
from classgrad.units import fmt_mib
from classgrad.workers.actor_runtime.stored_rows import project_rows_for
from classgrad.workers.engines.base import rnns_ready_for_backward
from classgrad.workers.engines.dense_engine import ROW_BYTES_BUDGET
from classgrad.workers.engines.partitioned.engine import GROUP_BYTES
from classgrad.workers.projection import RowProjector

log = logging.getLogger(__name__)

ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
PER_ROW_BYTES = 4 + 4 + 8  # row_scale + loss (float32) + count (int64)
# VmHWM of a fresh Python that imported torch 2.13 (CPU build) and classgrad.workers.actor_runtime.actor,
# measured 2026-12-02 on the dev machine: 253 MiB (a child process, before it built anything). A CUDA
# build of torch maps more; its context is counted apart.
PROCESS_BYTES = 256 << 20
# Ray's core worker inside each actor process (its threads, its object store client, the imported
# ray package): measured 2026-12-02 on the dev machine as 48 MiB (an actor that imported classgrad's
# worker modules: 290 MiB RSS; the same imports without Ray: 242 MiB), rounded up.
RAY_ACTOR_BYTES = 64 << 20
# A local Ray's own processes beside the driver (GCS, raylet, dashboard agent, runtime-env agent,
# log monitor and idle workers): measured 2026-12-02 on the dev machine as 550 MiB in all with
# `ray.init(include_dashboard=False)`, rounded up for the dashboard.
RAY_NODE_BYTES = 768 << 20
# Host memory of a CUDA context (driver libraries and their mappings): an allowance, not measured
# here (no GPU on the dev machine).
CUDA_HOST_BYTES = 512 << 20
# One micro-batch's peak over what autograd saves for it: the saved tensors, the gradients of the
# activations during the backward, and the hook path's captured inputs and output gradients.
# Measured 2026-12-02 at about 2.3x-2.4x (a child's peak over its build, against the saved bytes) on
# zoo.small_cnn and zoo.bn_cnn of width 32 over 64x64 images in batches of 128 (hooks and vmap).
ACTIVATION_FACTOR = 2.5
WRITER_RUNS = 3  # ShardWriter: max_pending queued runs plus the one being written
SAMPLES_MEASURED = 4  # probe samples of the forward whose saved tensors are measured


@dataclass(frozen=True)
class Part:
    """One part of a peak: what it is, its bytes, and the config key that changes it."""

    name: str
    bytes: int
    key: str | None  # None: nothing in the job file changes it
    detail: str = ""


@dataclass
class Footprint:
    """A job's store size and peak memory per actor and for the driver (see the module docstring)."""

    num_classes: int
    dim_in: int  # D, the selected parameters
    dim: int  # stored row width (k when projected)
    store_dtype: str
    store_bytes: int  # grads + row_scale + loss + count, as arrays
    store_disk_bytes: int  # the same in whole chunks (uncompressed): what a local disk must hold
    device: str
    actor: list[Part] = field(default_factory=list)  # host memory of one actor
    device_parts: list[Part] = field(default_factory=list)  # GPU memory of one actor (empty on a CPU)
    driver: list[Part] = field(default_factory=list)

    @property
    def actor_bytes(self) -> int:
        return sum(p.bytes for p in self.actor)

    @property
    def device_bytes(self) -> int:
        return sum(p.bytes for p in self.device_parts)

    @property
    def driver_bytes(self) -> int:
        return sum(p.bytes for p in self.driver)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, with the totals (what the run history records)."""
        data = asdict(self)
        data.update(actor_bytes=self.actor_bytes, device_bytes=self.device_bytes, driver_bytes=self.driver_bytes)
        return data

    def lines(self) -> list[str]:
        """``classgrad estimate``'s lines of the model."""
        out = [
            f"store      {self.num_classes} x {self.dim} {self.store_dtype} = {mb(self.store_bytes)} "
            f"({mb(self.store_disk_bytes)} in whole chunks)",
            f"actor      peak RSS ~{mb(self.actor_bytes)}: {parts_text(self.actor)}",
        ]
        if self.device_parts:
            out.append(f"actor GPU  ~{mb(self.device_bytes)}: {parts_text(self.device_parts)}")
        out.append(f"driver     peak RSS ~{mb(self.driver_bytes)}: {parts_text(self.driver)}")
        return out


def mb(n: float) -> str:
    """Bytes in one short figure, in the binary units every command uses (``units.fmt_mib``:
    whole MiB below 1 GiB, GiB and TiB with one decimal above)."""
    return fmt_mib(n)


def parts_text(parts: list[Part]) -> str:
    return ", ".join(f"{p.name} {mb(p.bytes)}" for p in parts if p.bytes)


class BuildMeter:
    """How much resident memory the code inside ``with`` added at its peak (Linux: the kernel's
    high-water mark, reset on entry; ``grown`` is None where that cannot be read)."""

    def __init__(self) -> None:
        self.grown: int | None = None
        self._start: int | None = None

    @classmethod
    def started(cls) -> BuildMeter:
        return cls().__enter__()

    def stop(self) -> int | None:
        self.__exit__()
        return self.grown

    def __enter__(self) -> BuildMeter:
        self._start = _rss_now() if _reset_high_water_mark() else None
        return self

    def __exit__(self, *exc: object) -> None:
        peak = _high_water_mark()
        if self._start is not None and peak is not None:
            self.grown = max(0, peak - self._start)


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return _high_water_mark() is not None


def _high_water_mark() -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rss_now() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def saved_bytes(engine: Any, samples: int = SAMPLES_MEASURED) -> tuple[int, int]:
    """``(per sample, per forward)``: what autograd saves for the backward, from forwards of the
    first ``samples`` probe samples and of half as many. Their difference is the part that grows
    with the batch; the rest is saved once a forward (autocast's low-precision copies of the
    weights: a ResNet-18's 10,000-class head alone is 9.8 MiB in bf16, which divided by four
    samples and multiplied by a batch of 1,024 made 9 GiB of "activations"). (0, 0) when a
    forward cannot be measured."""
    n = min(len(engine.probe), samples)
    full = _saved_in_forward(engine, n)
    if not full:
        return 0, 0
    half = _saved_in_forward(engine, n // 2) if n >= 2 else None
    if half is None:  # one sample, or a forward of half as many failed: all of it per sample
        return math.ceil(full / n), 0
    per_sample = math.ceil(max(0, full - half) / (n - n // 2))
    return per_sample, max(0, full - per_sample * n)


def _saved_in_forward(engine: Any, n: int) -> int | None:
    """Bytes autograd saves (parameters excluded) in a forward of the loss on the first ``n``
    probe samples, as the engine's forwards run; None when that forward fails."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            return t
        ptr = storage.data_ptr()
        if ptr not in params:
            saved[ptr] = max(saved.get(ptr, 0), storage.nbytes())
        return t

    # A forward in train mode updates running statistics: the buffers are put back as they were, so
    # the run's identity (a digest of the model as built, buffers included) stays the actors'.
    buffers = [(b, b.detach().clone()) for b in engine.model.buffers()]
    try:
        x, y = engine.probe.batch(torch.arange(n), engine.device, engine.compute_dtype)
        with engine.selected_grads(), torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                # As the engine's forwards run (an eval-mode RNN as for a backward: cuDNN's reserve).
                with engine.precision.autocast(engine.device), rnns_ready_for_backward(engine.model):
                    out = engine.io(x)
                engine.loss.batch_losses(out, y, engine.norm)
    except Exception as exc:  # noqa: BLE001 - the estimate goes without it; the job's own run will say
        log.debug("saved tensors not measured: %s", exc)
        return None
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    return sum(saved.values())


def _model_bytes(model: Any) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def _probe_bytes(probe: Any) -> int:
    """The probe set's tensors as held (targets, and its inputs when held as tensors)."""
    import torch

    total = probe.targets.numel() * probe.targets.element_size()
    inputs = getattr(probe, "_inputs", None)
    values = inputs.values() if isinstance(inputs, dict) else [inputs]
    for value in values:
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


def _group_rows(engine: Any, shard_rows: int) -> int:
    """Rows the engine computes into one buffer: its own group size (``group_rows``, at most 1 GiB
    of rows; the partitioned engine's groups of a new buffer per group at most 32 MiB, at least 16
    rows), and never more than a shard."""

    row_bytes = 4 * engine.layout.dim
    group = min(engine.group_rows, max(1, ROW_BYTES_BUDGET // row_bytes))
    if engine.name == "partitioned":
        group = min(group, 1 << max(4, (GROUP_BYTES // row_bytes).bit_length() - 1))
    return max(1, min(group, shard_rows, engine.loss.num_classes))


def _batch_samples(engine: Any, batch_size: int, group: int) -> int:
    """Samples in one forward: a micro-batch of the probe set; for the partitioned engine a run of at
    most a group's classes (or one class alone), so at most the ``group`` largest classes' samples."""
    batch = min(batch_size, len(engine.probe))
    counts = getattr(engine, "counts", None)
    if engine.name != "partitioned" or counts is None or not len(counts):
        return batch
    largest = counts.sort(descending=True).values[:group]
    return max(1, min(batch, int(largest.sum())))


def _projection_parts(
    projector: RowProjector | None, dim_in: int, group: int, shard_rows: int, rows_key: str
) -> list[Part]:
    """Finished rows gathered before a projection (the engine's blocks, beyond the group in the rows
    part, and their merged copy), the projected rows, and the projector's own buffers (its
    ``buffers()``: a dense projector's block of R; a sketch's indices)."""

    if projector is None:
        return []
    k = int(projector.out_dim)
    # Blocks are gathered until project_rows is reached, within a shard; torch.cat copies them.
    gathered = min(project_rows_for(dim_in) + group - 1, shard_rows)
    parts = [
        Part("gathered rows", (2 * gathered - group) * dim_in * 4, rows_key, f"{gathered} rows and their copy"),
        Part("projected rows", gathered * k * 4, "projection.dim", f"{gathered} rows of {k}"),
    ]
    return parts + [Part(what, nbytes, key) for what, nbytes, key in projector.buffers()]


def job_footprint(
    config: JobConfig,
    engine: Any,
    projector: Any,
    dim: int,
    *,
    build_bytes: int | None = None,
    saved_per_sample: int | None = None,
    under_ray: bool = True,
    device: str | None = None,
) -> Footprint:
    """The footprint of ``config``'s job from its engine as built (on any device: the parts that a
    GPU actor holds on its GPU are computed from the job's device). ``build_bytes``: what the
    driver's own build grew its memory by (``BuildMeter``); ``saved_per_sample``: autograd's saved
    bytes per sample (measured here when None); ``under_ray``: count Ray's share of each process;
    ``device``: where the actors compute (default: the job's device)."""
    C = config.loss.num_classes
    D = engine.layout.dim
    item = ITEM_BYTES[config.store.dtype]
    chunk_rows = config.store.row_chunk
    chunk_cols = min(config.store.col_chunk, dim)
    row_chunks, col_chunks = math.ceil(C / chunk_rows), math.ceil(dim / chunk_cols)
    # Whole chunks, each with its 4-byte crc32c; the per-row arrays are chunked by rows alike.
    disk = row_chunks * col_chunks * (chunk_rows * chunk_cols * item + 4) + 3 * row_chunks * 4
    disk += row_chunks * chunk_rows * PER_ROW_BYTES
    device = device or config.resolved_device()
    on_gpu = device.startswith("cuda")
    saved_per_forward = 0
    if saved_per_sample is None:
        saved_per_sample, saved_per_forward = saved_bytes(engine)
    model = _model_bytes(engine.model)
    probe = _probe_bytes(engine.probe)
    shard_rows = min(config.sharding.shard_rows, C)
    group = _group_rows(engine, shard_rows)
    batch = _batch_samples(engine, config.data.batch_size, group)
    rows_key = "engine.group_rows" if group > 1 else "params.include"
    activations = Part(
        "activations",
        int((batch * saved_per_sample + saved_per_forward) * ACTIVATION_FACTOR),
        "data.batch_size",
        f"({batch} samples x {saved_per_sample} B + {saved_per_forward} B) saved x {ACTIVATION_FACTOR}",
    )
    # Float32 rows stored as float32 from a CPU engine reach the writer as views of the engine's
    # buffers: up to WRITER_RUNS groups wait in the writer beside the one being computed.
    views = projector is None and config.store.dtype == "float32" and not on_gpu
    alive = min(shard_rows, group * (1 + WRITER_RUNS)) if views else group
    largest = max((s.size for s in engine.layout.slots), default=0)
    compute = [
        activations,
        Part("rows", alive * D * 4, rows_key, f"{alive} rows of {D} float32"),
        # Each parameter's gradients of a group, formed before they are written into the rows.
        Part("parameter gradients", group * largest * 4, rows_key, f"{group} x the largest parameter ({largest})"),
    ]
    if engine.name == "partitioned":  # the once-per-model spot check: two rows the plain way and a gradient
        compute.append(Part("spot check", 3 * D * 4, "params.include", "3 rows"))
    if engine.name == "dense" and engine.block_rows:  # VJPs of a block of rows batched through the backward
        block = min(engine.block_rows, C)
        compute.append(
            Part("VJP block", block * batch * saved_per_sample, "engine.block_rows", f"{block} rows x {batch} samples")
        )
    compute += _projection_parts(projector, D, group, shard_rows, rows_key)
    run_rows = max(chunk_rows, group)
    writer = Part(
        "writer",
        max(0 if views else WRITER_RUNS * run_rows * dim * item, chunk_rows * chunk_cols * item),
        "store.row_chunk" if chunk_rows > group else ("projection.dim" if dim != D else "params.include"),
        f"{WRITER_RUNS} runs of {run_rows} rows of {dim} {config.store.dtype}",
    )
    process = PROCESS_BYTES + (RAY_ACTOR_BYTES if under_ray else 0) + (CUDA_HOST_BYTES if on_gpu else 0)
    held = model + probe
    measured = build_bytes if build_bytes is not None else 0
    build_parts = [
        Part("model", model, "model.factory", "parameters and buffers"),
        Part("probe set", probe, "data.kwargs", "its tensors"),
        Part("build", max(0, measured - held), None, "imports and transients of the build, measured on the driver"),
    ]
    actor = [Part("process", process, None)]
    device_parts: list[Part] = []
    if on_gpu:  # the probe set stays on the host; the model and the work move to the GPU
        actor += [p for p in build_parts if p.name != "model"] + [writer]
        device_parts = [build_parts[0], *compute]
    else:
        actor += build_parts + compute + [writer]
    driver = [
        Part("process", PROCESS_BYTES + (RAY_NODE_BYTES if under_ray and starts_local_ray(config) else 0), None),
        *build_parts,
    ]
    return Footprint(
        num_classes=C,
        dim_in=D,
        dim=dim,
        store_dtype=config.store.dtype,
        store_bytes=C * dim * item + C * PER_ROW_BYTES,
        store_disk_bytes=disk,
        device=device,
        actor=actor,
        device_parts=device_parts,
        driver=driver,
    )


def starts_local_ray(config: JobConfig) -> bool:
    from classgrad.service.driver_runtime.ray_session import resolve_ray_address

    return resolve_ray_address(config.cluster.address)[0] is None
