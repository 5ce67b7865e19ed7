"""A store as a lazy xarray Dataset of true values: ``classgrad.open_dataset(url)``.

Holds ``store_dataset`` (the Dataset of an open ``GradStore``, behind ``GradStore.to_xarray``
and ``open_dataset`` in ``create``). ``grads`` is float32
true values whatever the stored dtype (bfloat16 bits and float16 decoded, row_scale applied,
chunk by chunk through dask), NaN in rows of shards not marked done; coordinates and dimension
names are those of format 3 for stores of every format (``format`` describes them), except the
parameters: ``param`` is each column's parameter name (along ``column``, indexed, a pandas
categorical: a byte or two a column), so ``ds["grads"].sel(param="fc1.weight")`` gives that
parameter's columns, and the layout table is along ``parameter`` (``PARAMETER_DIM``: its names,
with ``param_offset``, ``param_size`` and ``param_shape`` as a tuple of ints). Needs xarray and
dask (``pip install 'classgrad[read]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from classgrad.errors import StoreError
from classgrad.store.core.coords import array_attributes, coordinate_values
from classgrad.store.core.format import (
    ARRAY_DIMS,
    CLASS_ID,
    COL_DIM,
    OTHER_ROW_DIM,
    PARAM,
    PARAM_ID,
    PARAM_OFFSET,
    PARAM_SHAPE,
    PARAM_SIZE,
    RESULT_ARRAYS,
    SIM,
)

# The dimension of the layout table in the Dataset (``param`` is each column's parameter there).
PARAMETER_DIM = "parameter"

if TYPE_CHECKING:
    import xarray as xr

    from classgrad.store.core.format import StoreSpec
    from classgrad.store.rows.arrays import StoreArrays


def store_dataset(
    arrays: StoreArrays, spec: StoreSpec, grads: Any, *, done: Any, version: int, similarity: dict | None
) -> xr.Dataset:
    """The Dataset of an open store: ``grads`` (class_id, column) of float32 true values,
    ``loss`` and ``count`` (class_id), ``shard_done`` (shard), and the finished results of
    ``classgrad similarity`` if any; coordinates ``class_id``, ``class_name`` (when known), and
    unless the rows are projected ``param`` and ``param_id`` (column) and ``parameter`` with
    ``param_offset``, ``param_size``, ``param_shape`` (parameter). ``grads`` is the store's lazy
    true values (``to_dask``), ``done`` the done flags read when it was made (``shard_done`` is
    those flags, in memory: a lazy array of one-element chunks is a task per shard),
    ``similarity`` its similarity's attributes (or None)."""
    try:
        import dask.array as da
        import xarray as xr
    except ImportError:
        raise StoreError("open_dataset needs xarray and dask: pip install 'classgrad[read]'") from None
    attrs = array_attributes(spec)
    grads_attrs = {
        **attrs["grads"],
        "true_values": f"float32 true values, decoded by classgrad (stored as {spec.dtype})",
        "missing": "NaN in rows of shards not marked done when the Dataset was opened",
    }
    if spec.layout:
        grads_attrs["columns"] = (
            "the selected parameters, flattened and concatenated in row order: grads.sel(param=name) "
            "gives one parameter's columns; its shape is param_shape.sel(parameter=name).item()"
        )
    data: dict[str, Any] = {"grads": (ARRAY_DIMS["grads"], grads, grads_attrs)}
    for name in ("loss", "count"):
        arr = arrays[name]
        data[name] = (ARRAY_DIMS[name], arrays.lazy(name, arr.chunks, done), attrs[name])
    done_attrs = {**attrs["shard_done"], "read": "when the Dataset was opened (as the NaNs of grads)"}
    data["shard_done"] = (ARRAY_DIMS["shard_done"], done.astype(np.uint8), done_attrs)
    coords: dict[str, Any] = {}
    values_of = coordinate_values(spec)
    if spec.layout:
        coords.update(_parameter_coords(spec, values_of, attrs))
    for name, values in values_of.items():
        if name in _TABLE:
            continue  # above
        if name == PARAM_ID:
            stored = arrays.result(PARAM_ID)  # format 3 keeps it; older stores: made here
            lazy = da.from_zarr(stored) if stored is not None else da.from_array(values, chunks=spec.col_chunk)
            coords[name] = (ARRAY_DIMS[name], lazy, attrs[name])
        else:
            coords[name] = (ARRAY_DIMS[name], values.astype(str) if values.dtype == object else values, attrs[name])
    info = similarity
    if info is not None and info.get("state") == "ready" and info.get("source_fingerprint") == spec.fingerprint:
        for name in RESULT_ARRAYS:
            result = arrays.result(name)
            if result is not None:
                data[name] = (ARRAY_DIMS[name], da.from_zarr(result, chunks=result.chunks), dict(result.attrs))
        if SIM in data:
            coords[OTHER_ROW_DIM] = ((OTHER_ROW_DIM,), coords[CLASS_ID][1], {"long_name": "class id of the column"})
    ds = xr.Dataset(data, coords=coords)
    if spec.layout:
        ds = ds.set_xindex(PARAM)  # sel(param=name): a slice of the columns (they are contiguous)
    ds.attrs.update(
        {
            "url": arrays.url,
            "format_version": version,
            "stored_dtype": spec.dtype,
            "fingerprint": spec.fingerprint,
            "loss_kind": spec.loss_kind,
            "projection": "none" if spec.projection is None else str(spec.projection),
        }
    )
    return ds


_TABLE = (PARAM, PARAM_OFFSET, PARAM_SIZE, PARAM_SHAPE)


def _parameter_coords(spec: StoreSpec, values: dict, attrs: dict[str, dict]) -> dict[str, Any]:
    """``param`` along ``column`` (each column's parameter name: a categorical over the layout's
    names, from the column's position in it) and the layout table along ``parameter``."""
    import numpy as np
    import pandas as pd

    names = [str(n) for n in values[PARAM]]
    codes = np.repeat(np.arange(len(names), dtype=np.int32), values[PARAM_SIZE])
    per_column = pd.Categorical.from_codes(codes, categories=pd.Index(names, dtype=object))
    shapes = np.empty(len(spec.layout), dtype=object)
    shapes[:] = [tuple(int(n) for n in slot.shape) for slot in spec.layout]
    table = (PARAMETER_DIM,)
    return {
        PARAM: (
            (COL_DIM,),
            per_column,
            {"long_name": "parameter of the column", "description": "each column's parameter: grads.sel(param=name)"},
        ),
        PARAMETER_DIM: (table, np.array(names, dtype=str), attrs[PARAM]),
        PARAM_OFFSET: (table, values[PARAM_OFFSET], attrs[PARAM_OFFSET]),
        PARAM_SIZE: (table, values[PARAM_SIZE], attrs[PARAM_SIZE]),
        PARAM_SHAPE: (table, shapes, {**attrs[PARAM_SHAPE], "description": "each parameter's shape, a tuple of ints"}),
    }
