"""Data between the host and the engine's device: where a micro-batch crosses, and waits.

Holds ``to_device`` (a tensor made on the host, queued to the device without waiting),
``read_back`` (the one read of a micro-batch's results: the host waits for the device here, and
nowhere else in a run), ``to_host`` (a copy of device data the host plans from, such as a
training batch's labels) and ``copy_to_host`` (finished rows off the device on a side stream,
beside the next micro-batch's compute, waited for by the writer thread). Callers use them
through this module (``host_device.read_back``), so that ``tests/support/host_reads.py`` counts
each call of ``read_back`` and ``to_host`` as one read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor made on the host, on ``device``: on a GPU copied from pinned memory without
    waiting (queued behind the work already launched, never a synchronisation)."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def read_back(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` (any shapes, any device) on the host as float64, in one copy: the host waits
    here for the device to finish the work queued before. Booleans read as 0.0 and 1.0."""
    flat = to_host(torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]))
    return list(flat.split([t.numel() for t in tensors]))


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the host (always a new tensor, also from a CPU tensor): the host waits
    here for the device to finish the work queued before."""
    return t.detach().to("cpu", copy=True)


# One side stream per CUDA device for copies to the host, so that they run beside the compute.
_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def copy_to_host(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, Callable[[], None]]:
    """``(host tensor, wait)``: ``t`` on the host in ``dtype``, without waiting on a GPU: copied
    into pinned memory on a side stream, behind the work that made ``t`` and beside the work
    queued after it; ``wait()`` returns once the copy is there (call it before reading the host
    tensor, e.g. on a writer thread). On a CPU the copy is made inline (none when ``t`` already
    is ``dtype``) and ``wait`` does nothing. ``t`` must not be written again before ``wait``
    returns (its memory is kept from reuse by the caching allocator meanwhile)."""
    if t.device.type != "cuda":
        return t.detach().to("cpu", dtype), _nothing
    stream = _COPY_STREAMS.get(t.device)
    if stream is None:
        stream = _COPY_STREAMS[t.device] = torch.cuda.Stream(t.device)
    host = torch.empty(t.shape, dtype=dtype, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(t.device))  # behind the work that made t
    with torch.cuda.stream(stream):
        host.copy_(t.detach(), non_blocking=True)
        t.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
    return host, done.synchronize


def _nothing() -> None:
    return None
