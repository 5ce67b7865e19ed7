"""The saved preconditioner of ``classgrad score --method trak``: the Gram matrix of a store's
rows, kept beside them in the store, recorded, checksummed and tied to the rows it came from.

Holds ``PRECONDITIONER`` (the array's key), ``rows_digest`` (a digest of what the rows are:
the store's fingerprint, metadata digest, ``shard_done`` marks and every shard record, so that
any recomputed or repaired shard changes it) and ``Preconditioners``
(``GradStore.preconditioner``): ``info``, ``save``, ``load`` and ``problem`` (for verify).

The array ``score_preconditioner`` is float64 ``[n, n]`` (dimension names ``gram_row`` and
``gram_col``): ``Phi^T Phi`` (n = k, the row width: ``form: features``) or ``Phi Phi^T``
(n = C: ``form: kernel``), with attributes ``form``, ``n``, ``trace``, ``mean_eigenvalue``
(trace / min(C, k), the mean of the nonzero eigenvalues when the rows have full rank),
``rows_digest``, ``source_fingerprint``, ``checksum`` (sha256 of the little-endian float64
bytes), ``state`` (``computing`` until written whole, then ``ready``) and timings. ``load``
refuses a matrix whose rows digest is not the store's current one (the rows changed since),
whose checksum does not match what is read, or that was not finished.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from zarr.codecs import BytesCodec

from classgrad.errors import ClassgradError, StoreError, StoreMismatchError, first_line
from classgrad.store.core.format import StoreSpec, codecs
from classgrad.store.core.location import Location
from classgrad.store.integrity.shard_records import record_key
from classgrad.store.rows.arrays import StoreArrays

PRECONDITIONER = "score_preconditioner"
PRECONDITIONER_DIMS = ("gram_row", "gram_col")
FORMS = ("features", "kernel")


def checksum(matrix: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(matrix, dtype="<f8").tobytes()).hexdigest()


def rows_digest(loc: Location, spec: StoreSpec, done: np.ndarray, metadata_digest: Any) -> str:
    """sha256 of the store's fingerprint, metadata digest, done marks and shard records."""
    h = hashlib.sha256(b"classgrad rows v1")
    h.update(spec.fingerprint.encode())
    h.update(json.dumps(metadata_digest, sort_keys=True, default=str).encode())
    h.update(np.ascontiguousarray(done, dtype=np.uint8).tobytes())
    shards = np.flatnonzero(done).tolist()
    for shard, record in zip(shards, loc.read_many([record_key(s) for s in shards])):
        h.update(f"{shard}:".encode() + (record or b"-"))
    return h.hexdigest()


class Preconditioners:
    """The saved preconditioner of one open store."""

    def __init__(self, arrays: StoreArrays, spec: StoreSpec, digest: Callable[[], str]) -> None:
        self._arrays = arrays
        self._spec = spec
        self._digest = digest

    def rows_digest(self) -> str:
        return self._digest()

    def info(self) -> dict | None:
        """Attributes of the saved matrix (None: none saved)."""
        arr = self._arrays.result(PRECONDITIONER)
        return None if arr is None else dict(arr.attrs)

    def save(self, matrix: np.ndarray, *, form: str, rows_digest: str, info: dict | None = None) -> dict:
        """Replace any saved matrix by ``matrix`` (float64 ``[n, n]``), marked ready once written."""
        self._arrays.require_writable()
        if form not in FORMS:
            raise StoreError(f"preconditioner form must be one of {', '.join(FORMS)}, got {form!r}")
        matrix = np.ascontiguousarray(matrix, dtype=np.float64)
        n = matrix.shape[0]
        if matrix.shape != (n, n) or not np.isfinite(matrix).all():
            raise StoreError(f"preconditioner: expected a finite square matrix, got shape {list(matrix.shape)}")
        attrs = json.loads(
            json.dumps(
                {
                    "form": form,
                    "n": n,
                    "trace": float(np.trace(matrix)),
                    "mean_eigenvalue": float(np.trace(matrix)) / max(1, min(self._spec.num_classes, self._spec.dim)),
                    "rows_digest": rows_digest,
                    "source_fingerprint": self._spec.fingerprint,
                    "checksum": checksum(matrix),
                    "state": "computing",
                    "saved": time.time(),
                    **(info or {}),
                },
                default=str,
            )
        )
        group = self._arrays.group
        chunk = max(1, min(n, (8 << 20) // (8 * n)))
        try:
            if PRECONDITIONER in group:
                del group[PRECONDITIONER]
            self._arrays.forget(PRECONDITIONER)
            arr = group.create_array(
                PRECONDITIONER,
                shape=(n, n),
                chunks=(chunk, n),
                dtype="float64",
                fill_value=np.nan,
                serializer=BytesCodec(endian="little"),
                compressors=codecs("none"),
                dimension_names=PRECONDITIONER_DIMS if self._arrays.version >= 3 else None,
                attributes=attrs,
            )
            for r in range(0, n, chunk):
                arr[r : r + chunk] = matrix[r : r + chunk]
            attrs["state"] = "ready"
            arr.update_attributes(attrs)
        except ClassgradError:
            raise
        except Exception as exc:
            raise StoreError(
                f"cannot save the preconditioner in {self._arrays.url}: {first_line(exc, with_type=True)}"
            ) from None
        self._arrays.consolidate()
        return attrs

    def load(self, *, form: str) -> tuple[np.ndarray, dict]:
        """The saved matrix of ``form`` and its attributes; refused (one line) when there is none,
        it is unfinished, of another form, made from other rows, or its bytes do not match."""
        url = self._arrays.url
        arr = self._arrays.result(PRECONDITIONER)
        info = None if arr is None else dict(arr.attrs)
        if arr is None or info is None or info.get("state") != "ready":
            raise StoreError(f"store {url} has no finished preconditioner")
        if info.get("form") != form:
            raise StoreMismatchError(f"the preconditioner of {url} is of form {info.get('form')!r}, not {form!r}")
        if info.get("rows_digest") != self._digest():
            raise StoreMismatchError(
                f"the rows of store {url} changed since its preconditioner was computed; "
                "recompute it (--recompute-preconditioner)"
            )
        return self._matrix(arr, info), info

    def problem(self) -> tuple[str, str] | None:
        """What ``classgrad verify`` says of the saved matrix: None (none saved, or sound), or
        ``(kind, line)``: ``unfinished``, ``stale`` (computed from other rows: ``load`` refuses
        it) or ``damaged`` (unreadable, or its bytes unlike its checksum). Reads it a chunk of
        rows at a time (n can be tens of thousands)."""
        url = self._arrays.url
        fix = "`classgrad score --method trak --recompute-preconditioner` replaces it"
        try:
            arr = self._arrays.result(PRECONDITIONER)
            if arr is None:
                return None
            info = dict(arr.attrs)
            if info.get("state") != "ready":
                return "unfinished", f"the preconditioner of {url} is unfinished; {fix}"
            if info.get("rows_digest") != self._digest():
                return "stale", f"the preconditioner of {url} was computed from other rows; {fix}"
            h = hashlib.sha256()
            step = max(1, arr.chunks[0])
            for start in range(0, arr.shape[0], step):  # C order: the digest of the whole matrix's bytes
                h.update(np.ascontiguousarray(arr[start : start + step], dtype="<f8").tobytes())
        except Exception as exc:  # noqa: BLE001 - a chunk failing its crc32c, garbled metadata, I/O
            return "damaged", f"cannot read the preconditioner of {url} ({first_line(exc, with_type=True)}); {fix}"
        if h.hexdigest() != info.get("checksum"):
            return "damaged", f"the preconditioner of {url} does not match its checksum; {fix}"
        return None

    def _matrix(self, arr: Any, info: dict) -> np.ndarray:
        url = self._arrays.url
        try:
            matrix = np.asarray(arr[...], dtype=np.float64)
        except Exception as exc:  # a chunk failing its crc32c (zarr raises ValueError), or I/O
            raise StoreError(
                f"cannot read the preconditioner of {url} ({first_line(exc, with_type=True)}); "
                "recompute it (--recompute-preconditioner)"
            ) from None
        if checksum(matrix) != info.get("checksum"):
            raise StoreMismatchError(
                f"the preconditioner of {url} does not match its checksum (damaged); "
                "recompute it (--recompute-preconditioner)"
            )
        return matrix
