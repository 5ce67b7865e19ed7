"""A store as a lazy xarray Dataset of true values: ``classgrad.open_dataset(url)``.

Holds ``store_dataset`` (the Dataset of an open ``GradStore``, behind ``GradStore.to_xarray``
and ``open_dataset`` in ``create``). ``grads`` is float32
true values whatever the stored dtype (bfloat16 bits and float16 decoded, row_scale applied,
chunk by chunk through dask), NaN in rows of shards not marked done; coordinates and dimension
names are those of format 3 for stores of every format (``format`` describes them). Needs
xarray and dask (``pip install 'classgrad[read]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from classgrad.service.errors import StoreError
from classgrad.service.store.coords import array_attributes, coordinate_values
from classgrad.service.store.format import (
    ARRAY_DIMS,
    CLASS_ID,
    OTHER_ROW_DIM,
    PARAM_ID,
    RESULT_ARRAYS,
    SIM,
)

if TYPE_CHECKING:
    import xarray as xr

    from classgrad.service.store.arrays import StoreArrays
    from classgrad.service.store.format import StoreSpec


def store_dataset(
    arrays: StoreArrays, spec: StoreSpec, grads: Any, *, version: int, similarity: dict | None
) -> xr.Dataset:
    """The Dataset of an open store: ``grads`` (class_id, column) of float32 true values,
    ``loss`` and ``count`` (class_id), ``shard_done`` (shard), and the finished results of
    ``classgrad similarity`` if any; coordinates ``class_id``, ``class_name`` (when known),
    ``param`` with ``param_offset``, ``param_size``, ``param_shape``, and ``param_id`` (column)
    unless the rows are projected. ``grads`` is the store's lazy true values (``to_dask``),
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
    data: dict[str, Any] = {"grads": (ARRAY_DIMS["grads"], grads, grads_attrs)}
    for name in ("loss", "count", "shard_done"):
        arr = arrays[name]
        data[name] = (ARRAY_DIMS[name], da.from_zarr(arr, chunks=arr.chunks), attrs[name])
    coords: dict[str, Any] = {}
    for name, values in coordinate_values(spec).items():
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
