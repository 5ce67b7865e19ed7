"""The training log's store: per-class gradient sums over windows of training steps (issue 48).

Holds ``LogSpec`` (what a log records, checked on every reopen so a resumed run never mixes
rows of another model, projection or window), ``open_log`` (a new log at ``url``, or the one
there reopened after its spec is compared), ``GradLogStore`` (a window's arrays written, then
marked done; the windows done; a resume that drops the windows at and after a step) and
``read_log`` (the done windows' arrays, for a reader).

Layout (a Zarr v3 group; ``xarray.open_zarr`` reads it, dims in each array's
``dimension_names``). Window ``w`` covers steps ``[w * window, (w + 1) * window)``:

- ``grads`` ``[window, class_id, column]`` float32: the sum over the window's steps of each
  class's row (projected to ``width`` columns, or whole);
- ``lr_grads`` ``[window, class_id, column]`` float32: the same, each step's row times its
  learning rate (what a TracIn-style score sums);
- ``count`` ``[window, class_id]`` int64: the class's samples in the window's steps;
- ``loss_sum`` ``[window, class_id]`` float64: their losses summed (0 where none were given);
- ``steps`` ``[window, bound]`` int64: the first step logged and one past the last;
- group attributes: ``grad_log`` (the spec) and ``done_windows`` (written only after the
  window's chunks are: a window not listed is absent, whatever its chunks hold).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import zarr

from classgrad.errors import StoreError, StoreMismatchError

SPEC_ATTR = "grad_log"
DONE_ATTR = "done_windows"
ROW_CHUNK = 256  # classes per chunk of grads: a window's chunk of 256 x 4,096 floats is 4 MiB
DIMS = {
    "grads": ("window", "class_id", "column"),
    "lr_grads": ("window", "class_id", "column"),
    "count": ("window", "class_id"),
    "loss_sum": ("window", "class_id"),
    "steps": ("window", "bound"),
}


@dataclass(frozen=True)
class LogSpec:
    """``num_classes`` rows of ``width`` columns per window of ``window`` steps; ``layout``: the
    model's selected parameters (name, shape) in row order; ``projection``: the map's record
    (None: whole rows); ``model``: the caller's fingerprint of the model (e.g. its class)."""

    num_classes: int
    width: int
    window: int
    layout: list = field(default_factory=list)
    projection: dict | None = None
    model: str = ""

    def differences(self, other: LogSpec) -> list[str]:
        mine, theirs = asdict(self), asdict(other)
        return [
            f"{k}: the log's {_short(theirs[k])}, this run's {_short(mine[k])}" for k in mine if mine[k] != theirs[k]
        ]


def _array(group: zarr.Group, name: str) -> zarr.Array:
    found = group[name]
    if not isinstance(found, zarr.Array):
        raise StoreError(f"grad log: {name} is not an array")
    return found


def _done(group: zarr.Group) -> list[int]:
    listed = group.attrs.get(DONE_ATTR, [])
    return sorted(int(w) for w in listed) if isinstance(listed, list) else []


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


class GradLogStore:
    """A log opened for writing: ``write_window`` then ``mark_done``; ``done`` lists the windows."""

    def __init__(self, group: zarr.Group, spec: LogSpec, url: str):
        self.group = group
        self.spec = spec
        self.url = url

    @property
    def done(self) -> list[int]:
        return _done(self.group)

    def write_window(
        self,
        w: int,
        grads: np.ndarray,
        lr_grads: np.ndarray,
        count: np.ndarray,
        loss_sum: np.ndarray,
        steps: tuple[int, int],
    ) -> None:
        """Window ``w``'s arrays (the arrays grow to hold it); not done until ``mark_done``."""
        values = {
            "grads": grads.astype(np.float32, copy=False),
            "lr_grads": lr_grads.astype(np.float32, copy=False),
            "count": count,
            "loss_sum": loss_sum,
            "steps": np.asarray(steps, dtype=np.int64),
        }
        for name, value in values.items():
            array = _array(self.group, name)
            if array.shape[0] <= w:
                array.resize((w + 1, *array.shape[1:]))
            array[w] = value

    def mark_done(self, w: int) -> None:
        self.group.attrs[DONE_ATTR] = sorted(set(self.done) | {w})

    def resume_at(self, step: int) -> None:
        """Drop the windows at and after ``step`` (a run restarted there recomputes them); a step
        inside a done window is refused (that window would mix two runs' steps)."""
        window = self.spec.window
        if step % window and (step // window) in self.done:
            raise StoreMismatchError(
                f"grad log {self.url}: step {step} is inside window {step // window} (steps "
                f"{step // window * window}-{(step // window + 1) * window - 1}), which is logged: "
                f"resume from a checkpoint at a window boundary (a multiple of {window})"
            )
        self.group.attrs[DONE_ATTR] = [w for w in self.done if (w + 1) * window <= step]


def open_log(url: str, spec: LogSpec, *, storage_options: dict | None = None, overwrite: bool = False) -> GradLogStore:
    """The log at ``url``: created with ``spec``, or reopened when its recorded spec equals
    ``spec`` (else one line naming each difference; ``overwrite`` replaces it)."""
    try:
        group = zarr.open_group(url, mode="w" if overwrite else "a", zarr_format=3, storage_options=storage_options)
    except Exception as exc:  # noqa: BLE001 - any backend's failure: one line naming the log
        raise StoreError(f"grad log {url}: cannot be opened ({type(exc).__name__}: {exc})") from None
    recorded = group.attrs.get(SPEC_ATTR)
    if recorded is None and (list(group.array_keys()) or list(group.group_keys())):
        raise StoreMismatchError(
            f"grad log {url}: the path holds a Zarr group that is not a grad log: log to another path"
        )
    if isinstance(recorded, dict):
        try:
            found = LogSpec(**recorded)
        except TypeError:
            raise StoreMismatchError(
                f"grad log {url}: its recorded spec is not one this classgrad reads ({_short(recorded)})"
            ) from None
        diffs = spec.differences(found)
        if diffs:
            raise StoreMismatchError(
                f"grad log {url} was written by another run ({'; '.join(diffs)}): "
                "log to another path, or pass overwrite=True to replace it"
            )
        return GradLogStore(group, spec, url)
    c, k = spec.num_classes, spec.width
    shapes = {
        "grads": ((0, c, k), (1, min(ROW_CHUNK, c), k), "float32"),
        "lr_grads": ((0, c, k), (1, min(ROW_CHUNK, c), k), "float32"),
        "count": ((0, c), (1, c), "int64"),
        "loss_sum": ((0, c), (1, c), "float64"),
        "steps": ((0, 2), (1, 2), "int64"),
    }
    for name, (shape, chunks, dtype) in shapes.items():
        group.create_array(name, shape=shape, chunks=chunks, dtype=dtype, fill_value=0, dimension_names=DIMS[name])
    group.attrs[SPEC_ATTR] = asdict(spec)
    group.attrs[DONE_ATTR] = []
    return GradLogStore(group, spec, url)


def read_log(url: str, *, storage_options: dict | None = None) -> dict[str, np.ndarray]:
    """The done windows of the log at ``url``: ``window`` (their indices) and each array of the
    layout, restricted to them (a window written but not marked done is left out)."""
    try:
        group = zarr.open_group(url, mode="r", storage_options=storage_options)
    except Exception as exc:  # noqa: BLE001 - any backend's failure: one line naming the log
        raise StoreError(f"grad log {url}: cannot be read ({type(exc).__name__}: {exc})") from None
    if SPEC_ATTR not in group.attrs:
        raise StoreError(f"grad log {url}: not a classgrad grad log (no {SPEC_ATTR!r} attribute)")
    done = _done(group)
    out = {"window": np.asarray(done, dtype=np.int64)}
    for name in DIMS:
        out[name] = np.asarray(_array(group, name)[:])[done]
    return out
