"""Data between the host and the engine's device: the only two crossings a micro-batch makes.

Holds ``to_device`` (a tensor made on the host, queued to the device without waiting),
``read_back`` (the one read of a micro-batch's results: the host waits for the device here, and
nowhere else in a run) and ``to_host`` (a copy of device data the host plans from, such as a
training batch's labels). Callers use them through this module (``host_device.read_back``), so
that ``tests/support/host_reads.py`` counts each call of the last two as one read.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor made on the host, on ``device``: on a GPU copied from pinned memory without
    waiting (queued behind the work already launched, never a synchronisation)."""
    if t.device == device:
        return t
    if device.type == "cuda":
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
