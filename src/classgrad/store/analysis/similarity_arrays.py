"""The similarity result arrays: the C x C matrix written by ``classgrad similarity`` (when
dense) and its top-k neighbour table.

Holds ``SimilarityArrays`` (``GradStore.similarity_arrays``): ``info``; for the driver of
``classgrad similarity`` ``begin`` (replace any previous result by empty arrays marked
"computing"; dense, or the top-k table alone), ``write_rows`` (dense: whole row chunks of the
matrix and their table, for one run), ``write_neighbours`` (top-k only: whole chunks of the
table) and ``finish`` (mark "ready"; the one place where a result's writing ends); for readers
``matrix`` and ``neighbours``, refused unless a finished result of the store's rows exists
(``matrix`` also unless it is dense). The result's attributes live on the matrix when there is
one, else on ``similarity_topk_index``. Their layout is described in ``format``'s docstring.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BytesCodec

from classgrad.errors import ClassgradError, StoreError, first_line
from classgrad.store.analysis.result_records import ChunkUnreadable, ResultRecords, checked_read, chunk_digests
from classgrad.store.core.format import (
    RESULT_ARRAYS,
    SIM,
    SIM_INDEX,
    SIM_VALUE,
    SIMILARITY_METRICS,
    StoreSpec,
    codecs,
)
from classgrad.store.core.indexing import row_ids
from classgrad.store.rows.arrays import StoreArrays

# write_rows hands zarr about this many bytes per call (whole chunks).
_SIM_WRITE_BYTES = 8 << 20


class SimilarityArrays:
    """The similarity result of one open store (its ``StoreArrays``)."""

    def __init__(self, arrays: StoreArrays, spec: StoreSpec) -> None:
        self._arrays = arrays
        self._spec = spec
        self._records = ResultRecords(arrays.loc)  # the digest of every chunk written, per run

    @property
    def _url(self) -> str:
        return self._arrays.url

    def _marker(self) -> zarr.Array | None:
        """The array holding the result's attributes: the matrix when there is one, else the
        top-k index table of a top-k-only result (an index table without a ``state`` is the
        leftover of a dense result being deleted: no result)."""
        arr = self._arrays.result(SIM)
        if arr is not None:
            return arr
        table = self._arrays.result(SIM_INDEX)
        return table if table is not None and "state" in table.attrs else None

    def info(self) -> dict | None:
        """Attributes of the stored similarity result (``metric``, ``dense`` (False: the top-k
        table alone, no matrix), ``state`` "computing" or "ready", ``top_k``, ``chunk_rows``,
        ``source_fingerprint``, ``run_id``, timings...), or None when ``classgrad similarity``
        has not been run on this store. Results written before ``dense`` existed are dense."""
        arr = self._marker()
        if arr is None:
            return None
        info = dict(arr.attrs)
        info.setdefault("dense", True)
        return info

    def begin(
        self, *, metric: str, top_k: int, chunk_rows: int, run_id: str, info: dict | None = None, dense: bool = True
    ) -> None:
        """Driver of ``classgrad similarity`` only: replace any previous result by empty
        arrays marked ``state: "computing"`` until ``finish``: the C x C matrix and the top-k
        table when ``dense``, else the top-k table alone (``top_k`` >= 1). The old result's
        marker is deleted first, so a rerun never mixes two runs' rows, and a run that dies
        part-way leaves a result that readers refuse instead of trust."""
        self._arrays.require_writable()
        C = self._spec.num_classes
        if metric not in SIMILARITY_METRICS:
            raise StoreError(f"similarity metric must be one of {', '.join(SIMILARITY_METRICS)}, got {metric!r}")
        if not 0 <= int(top_k) <= max(C - 1, 0):
            raise StoreError(f"top_k must lie in [0, {C - 1}] (self is excluded), got {top_k}")
        if not dense and not int(top_k):
            raise StoreError("a top-k-only similarity needs top_k >= 1 (with top_k 0 it would store nothing)")
        if not 1 <= int(chunk_rows) <= C:
            raise StoreError(f"similarity chunk_rows must lie in [1, {C}], got {chunk_rows}")
        top_k, chunk_rows = int(top_k), int(chunk_rows)
        attrs = json.loads(
            json.dumps(
                {
                    "metric": metric,
                    "state": "computing",
                    "top_k": top_k,
                    "chunk_rows": chunk_rows,
                    "source_fingerprint": self._spec.fingerprint,
                    "run_id": run_id,
                    "dense": bool(dense),
                    "neighbours": "similarity_topk_index holds row indices (row i is class "
                    "class_ids[i]), most similar first, ties by lower index, self excluded",
                    "started": time.time(),
                    "records": True,  # every chunk's digest in similarity_records/, checked on read
                    **(info or {}),
                },
                default=str,
            )
        )
        dim_names = self._arrays.dims  # the store's format's names (format 3: class_id, other_class_id...)
        arrays = [  # name, shape, chunks, dtype, fill, dimension names; the marker (attrs) last
            (SIM_VALUE, (C, top_k), (chunk_rows, max(top_k, 1)), "float32", np.nan, dim_names[SIM_VALUE]),
            (SIM_INDEX, (C, top_k), (chunk_rows, max(top_k, 1)), "int64", -1, dim_names[SIM_INDEX]),
            (SIM, (C, C), (chunk_rows, C), "float32", np.nan, dim_names[SIM]),
        ]
        marker = SIM if dense else SIM_INDEX
        group = self._arrays.group
        try:
            self._records.clear()  # the previous result's
            for name in RESULT_ARRAYS:
                if name in group:
                    del group[name]  # the markers first (matrix, index table): they mark a result
                self._arrays.forget(name)
            for name, shape, chunks, dtype, fill, dims in arrays:
                if (name != SIM and top_k == 0) or (name == SIM and not dense):
                    continue
                group.create_array(
                    name,
                    shape=shape,
                    chunks=chunks,
                    dtype=dtype,
                    fill_value=fill,
                    serializer=BytesCodec(endian="little"),
                    compressors=codecs("none"),
                    dimension_names=dims,
                    attributes=attrs if name == marker else {},
                )
        except ClassgradError:
            raise
        except Exception as exc:
            raise StoreError(
                f"cannot create the similarity arrays in {self._url}: {first_line(exc, with_type=True)}"
            ) from None
        self._arrays.consolidate()  # format 3: the arrays replaced, for xarray.open_zarr

    def _run(self, run_id: str) -> tuple[zarr.Array, dict]:
        arr = self._marker()
        info = None if arr is None else dict(arr.attrs)
        if info is None or info.get("run_id") != run_id or info.get("state") != "computing":
            now = "no similarity" if info is None else f"run {info.get('run_id')!r} ({info.get('state')})"
            raise StoreError(f"similarity run {run_id!r} no longer owns {self._url}: it now holds {now}")
        assert arr is not None  # info is None whenever arr is
        return arr, info

    def _check_table(self, start: int, n: int, k: int, index: Any, value: Any) -> tuple[np.ndarray, np.ndarray]:
        C = self._spec.num_classes
        index, value = np.asarray(index), np.asarray(value, dtype=np.float32)
        if index.shape != (n, k) or value.shape != (n, k):
            raise StoreError(
                f"similarity_arrays: top-k index and value must have shape "
                f"[{n}, {k}], got {list(index.shape)} and {list(value.shape)}"
            )
        if index.size and (index.min() < 0 or index.max() >= C):
            raise StoreError("similarity_arrays: top-k indices outside [0, C)")
        if not np.isfinite(value).all():
            raise StoreError(
                f"similarity_arrays: top-k values of rows [{start}, {start + n}) are not all "
                f"finite; refusing to store them"
            )
        return index.astype(np.int64), value

    def write_neighbours(self, start: int, index: np.ndarray, value: np.ndarray, *, run_id: str) -> None:
        """Top-k-only runs: store the neighbours of rows [start, start + n) ([n, top_k] row
        indices and values), for run ``run_id``; ``start`` and ``n`` cover whole chunks of
        ``chunk_rows`` rows (``n`` may end at the last row); non-finite values are refused."""
        self._arrays.require_writable()
        _, info = self._run(run_id)
        if info.get("dense", True):
            raise StoreError(f"similarity run {run_id!r} is dense: its rows are written with write_rows")
        C, k, rc = self._spec.num_classes, int(info["top_k"]), int(info["chunk_rows"])
        start, n = int(start), int(np.shape(index)[0]) if np.ndim(index) == 2 else 0
        stop = start + n
        if n == 0 or start < 0 or stop > C or start % rc or (n % rc and stop != C):
            raise StoreError(
                f"misaligned similarity write: rows [{start}, {stop}) must lie in [0, {C}), start at a "
                f"multiple of {rc} and cover whole chunks of {rc} rows"
            )
        index, value = self._check_table(start, n, k, index, value)
        try:
            for name, data in ((SIM_INDEX, index), (SIM_VALUE, value)):
                target = self._arrays.result(name)
                assert target is not None, f"{name} is missing"  # begin() made it
                target[start:stop] = data
            self._records.write(
                run_id,
                start,
                {
                    name: chunk_digests(name, run_id, start, data, rc)
                    for name, data in ((SIM_INDEX, index), (SIM_VALUE, value))
                },
            )
        except ClassgradError:
            raise
        except Exception as exc:
            raise StoreError(
                f"cannot write similarity neighbours [{start}, {stop}) to {self._url}: "
                f"{first_line(exc, with_type=True)}"
            ) from None

    def write_rows(
        self,
        start: int,
        values: np.ndarray,
        *,
        run_id: str,
        topk_index: np.ndarray | None = None,
        topk_value: np.ndarray | None = None,
    ) -> None:
        """Store rows [start, start + n) of the similarity matrix (float32 [n, C]) and their
        top-k neighbours ([n, top_k] row indices and values), for run ``run_id``.

        ``start`` and ``n`` must cover whole chunks of ``chunk_rows`` rows (``n`` may end at the
        last row), so each chunk is written whole, by one writer; non-finite values are refused.
        """
        self._arrays.require_writable()
        arr, info = self._run(run_id)
        if not info.get("dense", True):
            raise StoreError(f"similarity run {run_id!r} is top-k only: it has no matrix rows to write")
        C, k, rc = self._spec.num_classes, int(info["top_k"]), int(info["chunk_rows"])
        values = np.ascontiguousarray(values, dtype=np.float32)
        start = int(start)
        n = values.shape[0] if values.ndim == 2 else 0
        stop = start + n
        if values.ndim != 2 or values.shape[1] != C or n == 0 or start < 0 or stop > C:
            raise StoreError(
                f"similarity_arrays.write_rows: expected rows [n, {C}] inside [0, {C}), "
                f"got shape {list(values.shape)} at row {start}"
            )
        if start % rc or (n % rc and stop != C):
            raise StoreError(
                f"misaligned similarity write: rows [{start}, {stop}) must start at a "
                f"multiple of {rc} and cover whole chunks of {rc} rows"
            )
        if not np.isfinite(values).all():
            raise StoreError(
                f"similarity_arrays.write_rows: rows [{start}, {stop}) hold non-finite values; refusing to store them"
            )
        parts: list[tuple[str, np.ndarray]] = [(SIM, values)]
        if k:
            index, value = self._check_table(start, n, k, topk_index, topk_value)
            parts += [(SIM_INDEX, index), (SIM_VALUE, value)]
        # A few whole chunks per call: zarr encodes the chunks of one call concurrently, each
        # in several copies, so one call for a whole strip would double its memory.
        step = max(1, _SIM_WRITE_BYTES // (rc * C * 4)) * rc
        try:
            for name, data in parts:
                target = arr if name == SIM else self._arrays.result(name)
                assert target is not None, f"{name} is missing"  # begin() made it, as top_k > 0
                for r0 in range(0, n, step):
                    target[start + r0 : min(start + r0 + step, stop)] = data[r0 : r0 + step]
            self._records.write(
                run_id, start, {name: chunk_digests(name, run_id, start, data, rc) for name, data in parts}
            )
        except ClassgradError:
            raise
        except Exception as exc:
            raise StoreError(
                f"cannot write similarity rows [{start}, {stop}) to {self._url}: {first_line(exc, with_type=True)}"
            ) from None

    def finish(self, run_id: str, info: dict | None = None) -> None:
        """Mark run ``run_id``'s similarity complete (``state: "ready"``), adding ``info``: the
        last write of a ``classgrad similarity`` run, dense or top-k only."""
        self._arrays.require_writable()
        arr, attrs = self._run(run_id)
        attrs.update(json.loads(json.dumps(info or {}, default=str)))
        attrs.update(state="ready", finished=time.time())
        try:
            arr.update_attributes(attrs)
        except Exception as exc:
            raise StoreError(
                f"cannot finish the similarity of {self._url}: {first_line(exc, with_type=True)}"
            ) from None
        self._arrays.consolidate()  # format 3: the attributes changed, for xarray.open_zarr

    def _ready(self) -> tuple[zarr.Array, dict]:
        arr = self._marker()
        url, fingerprint = self._url, self._spec.fingerprint
        if arr is None:
            raise StoreError(f"store {url} has no similarity result; run `classgrad similarity {url}` first")
        info = dict(arr.attrs)
        if info.get("state") != "ready":
            raise StoreError(
                f"the similarity of {url} is unfinished (run "
                f"{info.get('run_id')!r} did not complete); rerun `classgrad "
                f"similarity`"
            )
        if info.get("source_fingerprint") != fingerprint:
            raise StoreError(
                f"the similarity of {url} was computed from other rows "
                f"(fingerprint {info.get('source_fingerprint')!r}, the store's "
                f"{fingerprint!r}); rerun `classgrad similarity`"
            )
        return arr, info

    def _read(self, arr: zarr.Array, name: str, ids: np.ndarray, cols: np.ndarray | None, info: dict) -> np.ndarray:
        uniq, inverse = np.unique(ids, return_inverse=True)
        ucols, col_inverse = (None, None) if cols is None else np.unique(cols, return_inverse=True)
        if uniq.size == 0:
            width = arr.shape[1] if cols is None else cols.size
            return np.empty((0, width), dtype=arr.dtype)
        if info.get("records"):  # every chunk against its record: a copied chunk is refused
            run_id = str(info.get("run_id"))
            expected = self._records.of_run(run_id).get(name, {})
            rows = checked_read(arr, name, uniq, run_id, expected, self._url)
            out = (rows if ucols is None else rows[:, ucols])[inverse.reshape(-1)]
        else:  # a result written before records
            out = self._arrays.read(name, uniq, ucols)[inverse.reshape(-1)]
        return out if col_inverse is None else out[:, col_inverse.reshape(-1)]

    def record_problems(self) -> list[str]:
        """What ``classgrad verify`` finds of a finished result against its records: every chunk
        read once (a chunk at a time), each refusal in one line. Empty without a finished result
        or without records (a result written before them)."""
        info = self.info()
        if info is None or info.get("state") != "ready" or not info.get("records"):
            return []
        run_id, out = str(info.get("run_id")), []
        for name in RESULT_ARRAYS:
            arr = self._arrays.result(name)
            if arr is None:
                continue
            expected = self._records.of_run(run_id).get(name, {})
            rc, n = int(arr.chunks[0]), int(arr.shape[0])
            for j in range(-(-n // rc)):
                try:
                    checked_read(arr, name, np.arange(j * rc, min((j + 1) * rc, n)), run_id, expected, self._url)
                except ChunkUnreadable:
                    continue  # the chunk scan reports it, with its key
                except ClassgradError as exc:
                    out.append(str(exc))
        return out

    def matrix(self, ids: Any = None, cols: Any = None) -> np.ndarray:
        """Rows ``ids`` (default all) and columns ``cols`` (default all) of the stored class
        similarity matrix, float32; refused unless a finished dense result of these rows exists."""
        arr, info = self._ready()
        C = self._spec.num_classes
        if not info.get("dense", True):
            raise StoreError(
                f"the similarity of {self._url} holds the top-{info.get('top_k')} neighbour table only "
                f"(no {C} x {C} matrix); read it with similarity_neighbours(), or rerun `classgrad "
                f"similarity --dense` for the matrix"
            )
        ids = row_ids(ids, C)
        cols = None if cols is None else row_ids(cols, C)
        return self._read(arr, SIM, ids, cols, info)

    def neighbours(self, ids: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k neighbours of rows ``ids`` (default all): (row indices int64 [n, k], values
        float32 [n, k]), most similar first, self excluded; row i is class ``class_ids[i]``."""
        _, info = self._ready()
        if not info.get("top_k"):
            raise StoreError(
                f"the similarity of {self._url} was computed with top_k 0; rerun `classgrad similarity --top-k K`"
            )
        ids = row_ids(ids, self._spec.num_classes)
        out = []
        for name in (SIM_INDEX, SIM_VALUE):
            arr = self._arrays.result(name)
            if arr is None:
                raise StoreError(f"store {self._url} has no '{name}' array although top_k > 0; it is damaged")
            out.append(self._read(arr, name, ids, None, info))
        index, value = out
        return index, value
