"""A training log as a lazy xarray Dataset whose every block is checked against its window's
record, read through the log's reader (row shards straight from their objects).

Holds ``open_log_dataset``. Why: zarr's own pipeline reads a log's one-row chunks one at a time,
about 20x slower than dense chunks (``benchmarks/training_log.py --parts``), and
``xarray.open_zarr`` reads blocks no record vouches for. Here ``grads`` and ``lr_grads`` are dask
arrays of one task per window and block of ``row_chunk`` classes (float32, bfloat16 logs decoded),
over the done windows only; ``count``, ``loss_sum`` and ``steps`` are read at once (a value per
class and window).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from classgrad.errors import StoreError
from classgrad.store.training_log.log_store import DIMS, SUM_ARRAYS, LogReader, open_log_reader


def open_log_dataset(url: str, *, storage_options: dict | None = None) -> Any:  # -> xarray.Dataset
    """The done windows of the log at ``url`` as a Dataset (dims ``window``, ``class_id``,
    ``column``, ``bound``; the ``window`` coordinate holds the windows' indices); a damaged or
    missing block raises ``StoreError`` when it is computed."""
    try:
        import dask.array as da
        import xarray as xr
    except ImportError:
        raise StoreError("open_log_dataset needs xarray and dask: pip install 'classgrad[read]'") from None
    reader = open_log_reader(url, storage_options=storage_options)
    done = reader.done
    data: dict[str, Any] = {}
    for name in DIMS:
        values = _lazy_sums(da, reader, name, done) if name in SUM_ARRAYS else reader.stacked(name)
        data[name] = (DIMS[name], values)
    coords = {
        "window": np.asarray(done, dtype=np.int64),
        "class_id": np.arange(reader.spec.num_classes),
        "column": np.arange(reader.spec.width),
    }
    return xr.Dataset(data, coords=coords, attrs={"url": url, "window_steps": reader.spec.window})


def _lazy_sums(da: Any, reader: LogReader, name: str, done: list[int]) -> Any:
    """``name`` over the done windows: a task per window and block of rows, each read (and
    checked) by ``reader``."""
    c, k, rc = reader.spec.num_classes, reader.spec.width, reader.row_chunk
    if not done:
        return da.zeros((0, c, k), dtype=np.float32, chunks=(1, rc, k))
    rows = tuple(min(rc, c - a) for a in range(0, c, rc))

    def block(block_info: dict | None = None) -> np.ndarray:
        assert block_info is not None  # dask passes each block's place
        (i, _), (a, b), _ = block_info[None]["array-location"]
        return reader.read(name, done[i], slice(a, b))[None]

    return da.map_blocks(
        block, chunks=((1,) * len(done), rows, (k,)), dtype=np.float32, meta=np.empty((0, 0, 0), np.float32)
    )
