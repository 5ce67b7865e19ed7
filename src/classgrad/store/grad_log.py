"""The training log's store: per-class gradient sums over windows of training steps (issue 48).

Holds ``LogSpec`` (what a log records, checked on every reopen so a resumed run never mixes
rows of another model, projection or window), ``open_log`` (a new log at ``url``, or the one
there reopened after its spec is compared), ``GradLogStore`` (a window's arrays written, then
marked done; the windows done; a resume that drops the windows at and after a step), and for
readers ``is_log`` (whether a path holds a log: what tells the commands a log from a job's
store), ``LogReader`` with ``open_log_reader`` (the spec, the done windows, one done window's
arrays read in blocks; a window not done, or past the arrays, refused in one line) and
``read_log`` (the done windows' arrays at once).

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

from classgrad.errors import StoreError, StoreIncompleteError, StoreMismatchError

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


def is_log(url: str, *, storage_options: dict | None = None) -> bool:
    """Whether ``url`` holds a training log: a Zarr group with the spec attribute ``open_log``
    writes (False for a job's store, another group, or nothing readable there)."""
    try:
        group = zarr.open_group(url, mode="r", storage_options=storage_options or None, use_consolidated=False)
    except Exception:  # noqa: BLE001 - whatever is there (or is not), it is not a log
        return False
    return isinstance(group.attrs.get(SPEC_ATTR), dict)


class LogReader:
    """A log opened for reading: ``spec``, ``done`` (the windows to read), ``held`` (the windows
    the arrays hold, done or not) and ``read`` (one done window of one array, or a block of it)."""

    def __init__(self, group: zarr.Group, spec: LogSpec, url: str):
        self.group = group
        self.spec = spec
        self.url = url
        self.done = _done(group)  # once: the attribute a writer may be changing is read one time
        self.held = int(_array(group, "steps").shape[0])
        self.row_chunk = int(_array(group, "grads").chunks[1])

    def check_window(self, w: int) -> None:
        """One line unless window ``w`` is done: past the arrays, or not (yet) marked done."""
        done = ", ".join(str(d) for d in self.done) or "none"
        if w < 0 or w >= self.held:
            raise StoreError(
                f"grad log {self.url}: window {w} is out of range (the log holds windows 0-{self.held - 1}; "
                f"done: {done})"
            )
        if w not in self.done:
            raise StoreIncompleteError(
                f"grad log {self.url}: window {w} is not done (its steps were not all logged, or a resume "
                f"dropped it; done windows: {done})"
            )

    def read(self, name: str, w: int, *index: slice | np.ndarray) -> np.ndarray:
        """``name``'s values of done window ``w``; ``index``: a slice or integer array per other
        dimension (each taken on its own, as ``numpy.ix_`` would)."""
        self.check_window(w)
        return np.asarray(_array(self.group, name).oindex[(w, *index)])


def open_log_reader(url: str, *, storage_options: dict | None = None) -> LogReader:
    """The log at ``url`` opened for reading (one line if it cannot be read or is not a log)."""
    try:
        group = zarr.open_group(url, mode="r", storage_options=storage_options or None, use_consolidated=False)
    except Exception as exc:  # noqa: BLE001 - any backend's failure: one line naming the log
        raise StoreError(f"grad log {url}: cannot be read ({type(exc).__name__}: {exc})") from None
    recorded = group.attrs.get(SPEC_ATTR)
    if not isinstance(recorded, dict):
        raise StoreError(f"grad log {url}: not a classgrad grad log (no {SPEC_ATTR!r} attribute)")
    try:
        spec = LogSpec(**recorded)
    except TypeError:
        raise StoreError(
            f"grad log {url}: its recorded spec is not one this classgrad reads ({_short(recorded)})"
        ) from None
    return LogReader(group, spec, url)


def read_log(url: str, *, storage_options: dict | None = None) -> dict[str, np.ndarray]:
    """The done windows of the log at ``url``: ``window`` (their indices) and each array of the
    layout, restricted to them (a window written but not marked done is left out)."""
    reader = open_log_reader(url, storage_options=storage_options)
    out = {"window": np.asarray(reader.done, dtype=np.int64)}
    for name in DIMS:
        out[name] = np.asarray(_array(reader.group, name)[:])[reader.done]
    return out
