"""An open gradient store: its metadata, rows in and out, and the collaborators that do the rest.

Holds ``GradStore``: opened by ``create_store`` or ``open_store``, it checks the store's format
version and state, and offers the metadata (``spec``, sizes, ``layout``, ``class_ids``...),
the row writer (``write_rows``, ``mark_shard_done``, ``durable``), completeness (``shard_done``,
``missing_ranges``; the shard records: ``shard_record``, ``damaged_done_shards``,
``unmark_damaged_shards``), the reader (``rows``, ``param``, ``iter_blocks``, ``block``,
``rows_band``, the per-row vectors, ``to_dask``, ``to_xarray``), the run history
(``append_run``), the recorded identity (``record_identity``), the consolidated metadata of
format 3 (``consolidate``, rewritten after each of those), the chunk
scan (``scan_chunks``, ``verify_chunks``) and the similarity reader (``similarity``...). The
work is done by the objects it holds: ``StoreArrays`` (arrays, reads with a diagnosis),
``RowWriter``, ``RowReader``, and, public, ``lease`` (``StoreLease``),
``similarity_arrays`` (``SimilarityArrays``) and ``preconditioner`` (``Preconditioners``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import zarr

from classgrad.errors import ClassgradError, StoreError, first_line
from classgrad.store.analysis.preconditioner import Preconditioners, rows_digest
from classgrad.store.analysis.similarity_arrays import SimilarityArrays
from classgrad.store.core.coords import consolidated_problems, recorded_names
from classgrad.store.core.format import (
    ARRAYS,
    ATTR_KEY,
    CLASS_NAME,
    FORMAT_VERSION,
    READABLE_VERSIONS,
    RUNS_DIR,
    StoreSpec,
    array_problems,
    spec_from_meta,
)
from classgrad.store.core.indexing import col_range, row_ids
from classgrad.store.core.location import Location, unreadable
from classgrad.store.core.params import ParamSlot
from classgrad.store.core.retry import io_error, retry_transient
from classgrad.store.integrity.lease import StoreLease
from classgrad.store.integrity.shard_records import ShardRecord, list_sizes, record_key, record_problems, shard_keys
from classgrad.store.integrity.verified import DigestCheckingStore, RecordedDigests, object_rows
from classgrad.store.rows.arrays import StoreArrays
from classgrad.store.rows.reader import RowReader
from classgrad.store.rows.writer import RowWriter
from classgrad.store.scan import ChunkProblem, scan_chunks
from classgrad.store.training_log.log_store import SPEC_ATTR as LOG_SPEC_ATTR

log = logging.getLogger(__name__)

_RUN_KEY = re.compile(rf"^{RUNS_DIR}/\d{{6}}\.json$")


class GradStore:
    """An open store. Build it with ``create_store`` or ``open_store``."""

    def __init__(self, loc: Location, mode: Literal["r", "r+"]) -> None:
        self._loc = loc
        self._mode = mode
        url = loc.url
        if loc.local and not os.path.isdir(loc.path):
            raise StoreError(f"no classgrad store at {url} (no such directory)")
        # Reads of recorded chunks are checked against their shard's record (``verified``) once
        # the store's shape is known (below).
        checking = DigestCheckingStore(loc.zarr_store(read_only=mode == "r"))
        try:
            group = zarr.open_group(checking, mode=mode, zarr_format=3, use_consolidated=False)
        except FileNotFoundError:
            raise StoreError(f"no classgrad store at {url} ({loc.why_absent()})") from None
        except ValueError as exc:  # a truncated or garbled zarr.json
            raise unreadable(url, "zarr.json", exc) from None
        except Exception as exc:
            raise StoreError(f"cannot open store at {url}: {first_line(exc, with_type=True)}") from None
        meta = group.attrs.get(ATTR_KEY)
        if not isinstance(meta, dict):
            if isinstance(group.attrs.get(LOG_SPEC_ATTR), dict):
                raise StoreError(
                    f"{url} is a training log (GradLog), not a job's store: read it with classgrad.store.read_log; "
                    "classgrad score, similarity and plot take it as it is"
                )
            raise StoreError(f"{url} is a Zarr group but not a classgrad store (no '{ATTR_KEY}' attributes)")
        version = meta.get("format_version")
        if version not in READABLE_VERSIONS:
            raise StoreError(
                f"store at {url} has format version {version}; this classgrad reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))} (it writes {FORMAT_VERSION})"
            )
        if meta.get("state") != "ready":
            raise StoreError(f"store at {url} was not fully created (interrupted); rerun the job to recreate it")
        self._meta = meta
        self._arrays = StoreArrays(loc, group, mode, version=int(version))
        try:
            self._spec = spec_from_meta(meta)
        except (KeyError, TypeError, StoreError) as exc:
            raise StoreError(
                f"store at {url} has damaged classgrad attributes: {first_line(exc, with_type=True)}"
            ) from None
        changed = array_problems({name: self._arrays[name] for name in ARRAYS}, self._spec)
        if changed:  # zarr.json edited by hand: reads would be silently wrong
            raise StoreError(f"store at {url}: {changed[0]}; it is damaged (`classgrad verify` says more)")
        ids = self._spec.class_ids
        self._class_ids = (
            np.arange(self.num_classes, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
        )
        self._class_ids.flags.writeable = False
        self._checking = checking
        self._names: tuple[str, ...] | None = None  # format 4's class names, once read
        self._named: tuple[StoreSpec, StoreSpec] | None = None  # (spec, the spec with those names)
        self._digests: RecordedDigests | None = None
        if self.format_version >= 2:  # format 1 has no records
            self._digests = RecordedDigests(url, object_rows(self._arrays), self._spec.shard_rows, self.generation)
            self.check_digests = True
        self._reader = RowReader(self._arrays, self._spec)
        self._writer = RowWriter(
            self._arrays, self._spec, self._class_ids, records=self.format_version >= 2, generation=self.generation
        )
        checking.written = self._writer.written
        checking.replacing = self._writer.replacing
        self.lease = StoreLease(loc, writable=mode != "r")
        self.similarity_arrays = SimilarityArrays(self._arrays, self._spec)
        # ``classgrad score --method trak``'s saved Gram matrix, tied to the rows by their digest.
        self.preconditioner = Preconditioners(
            self._arrays,
            self._spec,
            lambda: rows_digest(self._loc, self._spec, self.shard_done, self._meta.get("metadata_digest")),
        )

    @property
    def check_digests(self) -> bool:
        """Whether reads check each recorded chunk against its shard's record (``verified``): on
        for every store that has records (format 2 and later); off only to measure what it costs."""
        return self._checking.digests is not None

    @check_digests.setter
    def check_digests(self, value: bool) -> None:
        digests = self._digests if value else None
        self._checking.digests = self._arrays.digests = digests

    def __repr__(self) -> str:
        return f"GradStore({self.url!r}, {self.num_classes} x {self.dim} {self.dtype}, mode={self._mode!r})"

    # ----------------------------------------------------------------- metadata

    @property
    def url(self) -> str:
        return self._loc.url

    @property
    def local_path(self) -> str | None:
        """The store's directory (absolute, ``~`` expanded) when it is local, else None."""
        return self._loc.path if self._loc.local else None

    @property
    def generation(self) -> str | None:
        """Which creation of the store at this location this one is (None: made before stores had
        one): the records and run entries of a run that opened another creation are refused."""
        value = self._meta.get("generation")
        return None if value is None else str(value)

    @property
    def format_version(self) -> int:
        """The store's format version: 3 for stores made by this classgrad; 2 (no coordinates,
        dimensions named class and param, no consolidated metadata) and 1 (also no shard records
        nor metadata digest: done shards are trusted as marked) for older ones, which keep
        their version when resumed."""
        return int(self._meta["format_version"])

    @property
    def spec(self) -> StoreSpec:
        """What the store was created from (format 4's class names read from their array)."""
        names = self._names_in_array()
        if names is None:
            return self._spec
        if self._named is None or self._named[0] is not self._spec:  # once per spec, not per call
            self._named = (self._spec, dataclasses.replace(self._spec, class_names=names))
        return self._named[1]

    @property
    def num_classes(self) -> int:
        return self._spec.num_classes

    @property
    def dim(self) -> int:
        return self._spec.dim

    @property
    def dtype(self) -> str:
        return self._spec.dtype

    @property
    def row_chunk(self) -> int:
        return self._spec.row_chunk

    @property
    def col_chunk(self) -> int:
        return self._spec.col_chunk

    @property
    def shard_rows(self) -> int:
        return self._spec.shard_rows

    @property
    def num_shards(self) -> int:
        return self._spec.num_shards

    @property
    def write_align(self) -> int:
        """Rows a write must start at a multiple of (and cover): the unit stored as one object."""
        return self._spec.write_align

    @property
    def layout(self) -> tuple[ParamSlot, ...]:
        return self._spec.layout

    @property
    def class_ids(self) -> np.ndarray:
        """Class of each row (int64, read-only)."""
        return self._class_ids

    @property
    def class_names(self) -> list[str] | None:
        """Each row's class name (None: the classes have no names). Format 4 keeps them in
        the ``class_name`` coordinate array, read when first asked for and checked against the
        digest the attributes record (the names never enter the group's zarr.json)."""
        names = self._names_in_array() or self._spec.class_names
        return None if names is None else list(names)

    def _names_in_array(self) -> tuple[str, ...] | None:
        """Format 4's class names, read from their array and checked once; None for a store
        whose attributes hold them (or that has none)."""
        record = self._meta.get("class_names")
        if self._spec.class_names is not None or not isinstance(record, dict):
            return None
        if self._names is None:
            names, problem = recorded_names(self._arrays.group, record)
            if names is None:
                raise StoreError(
                    f"store {self.url}: its class names ({CLASS_NAME}) are not the ones it was created with "
                    f"({problem}); "
                    "`classgrad verify` says more"
                )
            self._names = names
        return self._names

    @property
    def fingerprint(self) -> str:
        return self._spec.fingerprint

    @property
    def attrs(self) -> dict:
        return copy.deepcopy(self._meta)

    def shard_range(self, shard: int) -> tuple[int, int]:
        """Rows [start, stop) of a work shard; the last one may be short."""
        return self._spec.shard_range(shard)

    # ----------------------------------------------------------------- writing

    def write_rows(self, start: int, rows: np.ndarray, *, loss: np.ndarray, count: np.ndarray) -> int:
        """Store rows [start, start + n): true float32 values, plus per-row loss and count.

        ``start`` must be a multiple of ``write_align`` and ``n`` too, unless the rows end at
        the last row, so every chunk is written whole, by one writer. Non-finite rows are
        refused. Returns the bytes handed to the store (before compression).
        """
        return self._writer.write_rows(start, rows, loss=loss, count=count)

    def mark_shard_done(self, shard: int) -> None:
        """Mark a shard complete; call only once all its rows have been written. Writes the
        shard's record first, and on local disks makes its chunks durable (fsync) before the mark."""
        self._writer.set_done(shard, 1)
        if self._digests is not None:
            self._digests.forget(shard)

    @property
    def durable(self) -> bool:
        """Whether ``mark_shard_done`` fsyncs local chunk files first (default; benchmarks turn it off)."""
        return self._writer.durable

    @durable.setter
    def durable(self, value: bool) -> None:
        self._writer.durable = bool(value)

    def clear_shard_done(self, shard: int) -> None:
        """Unmark a shard, then drop its record: a record exists only for a shard marked done, so
        readers never check a shard's new chunks against the record of its old ones."""
        self._writer.set_done(shard, 0)
        if self.format_version >= 2:
            try:
                retry_transient(lambda: self._loc.delete(record_key(shard)), f"deleting the record of shard {shard}")
            except Exception as exc:
                raise io_error(f"cannot delete the record of shard {shard} of {self.url}", exc) from None
        if self._digests is not None:
            self._digests.forget(shard)

    @property
    def runs(self) -> list[dict]:
        """The run history, oldest first: one record per run of the driver (and of the
        analysis commands that record theirs). Formats 1-3 keep it in the group's attributes;
        format 4 as one object per run (``runs/<n>.json``), read here in one listing and one
        batch of reads."""
        if self.format_version < 4:
            return copy.deepcopy(self._meta.get("runs", []))
        names = self._run_keys()
        out = []
        for name, data in zip(names, self._loc.read_many(names), strict=True):
            if data is None:
                continue  # deleted between the listing and the read
            try:
                out.append(json.loads(data))
            except ValueError:
                log.warning("store %s: run record %s is not JSON; skipped", self.url, name)
        return out

    def _run_keys(self) -> list[str]:
        try:
            return sorted(k for k in self._loc.list_folder(RUNS_DIR) if _RUN_KEY.match(k))
        except Exception as exc:
            raise io_error(f"cannot list the run history of {self.url}", exc) from None

    def append_run(self, entry: dict) -> None:
        """Append one run record (any JSON-serialisable dict) to the run history (``runs``)."""
        self._arrays.require_writable()
        entry = json.loads(json.dumps(entry, default=str))
        if self.format_version >= 4:
            self._append_run_object(entry)
            return

        def append() -> dict:
            group = zarr.open_group(
                self._loc.zarr_store(read_only=False), mode="r+", zarr_format=3, use_consolidated=False
            )
            meta = group.attrs[ATTR_KEY]
            assert isinstance(meta, dict)  # checked when the store was opened
            self._check_generation(meta)
            runs = meta.setdefault("runs", [])
            if not runs or runs[-1] != entry:  # a try whose answer was lost may have appended it
                runs.append(entry)
            group.update_attributes({ATTR_KEY: meta})
            return meta

        try:
            self._meta = retry_transient(append, f"recording the run in {self.url}")
        except ClassgradError:
            raise
        except Exception as exc:
            raise io_error(f"cannot record the run in {self.url}", exc) from None
        self.consolidate()

    def _append_run_object(self, entry: dict) -> None:
        """Format 4: the record as the next ``runs/<n>.json``; the group's metadata is not touched.
        The key is chosen once, so a try whose answer was lost writes the same object again."""
        data = json.dumps(entry, sort_keys=True).encode()
        try:
            meta = json.loads(self._loc.read_bytes("zarr.json") or b"{}").get("attributes", {}).get(ATTR_KEY, {})
            self._check_generation(meta)
            keys = self._run_keys()
            last = self._loc.read_bytes(keys[-1]) if keys else None
            if last is not None and json.loads(last) == entry:
                return  # already there
            key = f"{RUNS_DIR}/{len(keys):06d}.json"
            retry_transient(lambda: self._loc.write_bytes(key, data), f"recording the run in {self.url}")
        except ClassgradError:
            raise
        except Exception as exc:
            raise io_error(f"cannot record the run in {self.url}", exc) from None

    def _check_generation(self, meta: Any) -> None:
        if not isinstance(meta, dict) or meta.get("generation") != self._meta.get("generation"):
            raise StoreError(
                f"store {self.url} was created again by another run since this one opened it; "
                "this run's record is not appended to its history"
            )

    def record_identity(self, identity: dict) -> None:
        """Replace the recorded identity (``spec.identity``); the driver does it only while no
        shard is done, so no row was computed from the identity it replaces."""
        self._arrays.require_writable()
        identity = json.loads(json.dumps(identity))
        try:
            group = zarr.open_group(
                self._loc.zarr_store(read_only=False), mode="r+", zarr_format=3, use_consolidated=False
            )
            meta = group.attrs[ATTR_KEY]
            assert isinstance(meta, dict)  # checked when the store was opened
            meta["identity"] = identity
            group.update_attributes({ATTR_KEY: meta})
        except Exception as exc:
            raise StoreError(f"cannot record the identity in {self.url}: {first_line(exc, with_type=True)}") from None
        self._meta = meta
        self._spec = spec_from_meta(meta)
        self.consolidate()

    def consolidate(self) -> None:
        """Rewrite the consolidated metadata of a format-3 store (every array's metadata copied
        into the group's, what ``xarray.open_zarr(url)`` reads): call it after changing any
        metadata (arrays added or removed, attributes). Rows and done marks are chunk data and
        need none. Stores of formats 1 and 2 are left as they are (an older classgrad would
        trust a stale copy), so this does nothing there."""
        self._arrays.consolidate()

    # ----------------------------------------------------------------- completeness

    @property
    def shard_done(self) -> np.ndarray:
        return self._reader.shard_done()

    @property
    def is_complete(self) -> bool:
        return bool(self.shard_done.all())

    def shard_record(self, shard: int) -> ShardRecord | None:
        """The record written when ``shard`` was marked done (None: none, or unreadable)."""
        data = self._loc.read_bytes(record_key(shard))
        return None if data is None else ShardRecord.parse(data)

    def damaged_done_shards(self, done: np.ndarray | None = None) -> dict[int, list[str]]:
        """Done shards whose recorded chunks are missing or have another size, from one listing
        of the store (no chunk is read): shard -> problems. Done shards without a record count
        as damaged in a format-2 store and are trusted in a format-1 one (it has none)."""
        done = self.shard_done if done is None else done
        if not done.any():
            return {}
        try:
            sizes = list_sizes(self._loc)
        except OSError as exc:
            raise StoreError(f"cannot list the store {self.url}: {first_line(exc, with_type=True)}") from None
        shards = np.flatnonzero(done).tolist()
        recorded = [s for s in shards if record_key(s) in sizes]
        try:  # in one batch: concurrent requests on object storage
            records = dict(zip(recorded, self._loc.read_many([record_key(s) for s in recorded])))
        except Exception as exc:  # OSError, and object storage clients' own errors (botocore's)
            raise io_error(f"cannot read the shard records of {self.url}", exc) from None
        damaged = {}
        for shard in shards:
            if shard not in records and self.format_version < 2:
                continue
            data = records.get(shard)
            record = None if data is None else ShardRecord.parse(data)
            expected = shard_keys(self._arrays, self.shard_range(shard))
            problems = record_problems(record, sizes, self.generation, expected)
            if problems:
                damaged[shard] = problems
        return damaged

    def unmark_damaged_shards(self) -> np.ndarray:
        """``shard_done`` after unmarking (with a warning naming each) every done shard whose
        recorded chunks are missing or resized: what a resume runs before trusting done shards."""
        done = self.shard_done
        for shard, problems in self.damaged_done_shards(done).items():
            start, stop = self.shard_range(shard)
            log.warning(
                "store %s: shard %d (rows %d-%d) is marked done but %s; unmarking it so that it is recomputed",
                self.url,
                shard,
                start,
                stop - 1,
                "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""),
            )
            self.clear_shard_done(shard)
            done[shard] = False
        return done

    def missing_ranges(self, done: np.ndarray | None = None) -> list[tuple[int, int]]:
        """Merged [start, stop) row ranges of shards not marked done. Pass ``done`` when the
        caller has already read ``shard_done`` (each read is one request per shard on S3)."""
        return self._reader.missing_ranges(done)

    # ----------------------------------------------------------------- reading

    def rows(self, ids: Any, *, allow_missing: bool = False) -> np.ndarray:
        """True float32 rows [len(ids), dim] at row indices ``ids`` (row i is class class_ids[i]).

        Rows of shards not marked done raise ``StoreIncompleteError`` naming them, unless
        ``allow_missing`` (then they come back as NaN).
        """
        return self._reader.gather(row_ids(ids, self.num_classes), slice(0, self.dim), allow_missing)

    def param(self, name: str, ids: Any, *, allow_missing: bool = False) -> np.ndarray:
        """One parameter's part of rows ``ids``, shaped [len(ids), *shape of the parameter]."""
        return self._reader.param(name, ids, allow_missing)

    def iter_blocks(self, rows_per_block: int, *, allow_missing: bool = False) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (start, true float32 rows) in row order; blocks are whole row-chunks when
        ``rows_per_block >= row_chunk``. Incompleteness is reported before the first block."""
        return self._reader.iter_blocks(rows_per_block, allow_missing)

    def block(
        self, start: int, stop: int, cols: slice | tuple[int, int] | None = None, *, allow_missing: bool = False
    ) -> np.ndarray:
        """True float32 values of rows [start, stop) and columns ``cols`` (a slice or a
        (start, stop) pair; default every column): the unit out-of-core jobs read."""
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= self.num_classes:
            raise StoreError(f"block: rows [{start}, {stop}) are outside [0, {self.num_classes})")
        cols = col_range(cols, self.dim)
        if start == stop:
            return np.empty((0, cols.stop - cols.start), dtype=np.float32)
        return self._reader.gather(np.arange(start, stop, dtype=np.int64), cols, allow_missing)

    def rows_band(self, ids: Any, cols: slice | tuple[int, int], *, allow_missing: bool = False) -> np.ndarray:
        """True float32 values of rows ``ids`` (any order, repeats allowed) in one column range:
        ``rows`` for a few scattered rows whose full length would not fit in memory."""
        return self._reader.gather(row_ids(ids, self.num_classes), col_range(cols, self.dim), allow_missing)

    def loss(self, ids: Any = None) -> np.ndarray:
        """Per-row loss (NaN where never written)."""
        return self._reader.vector("loss", ids)

    def count(self, ids: Any = None) -> np.ndarray:
        """Per-row probe-sample count (-1 where never written)."""
        return self._reader.vector("count", ids)

    def row_scale(self, ids: Any = None) -> np.ndarray:
        """Per-row scale: true row = stored row * row_scale (NaN where never written)."""
        return self._reader.vector("row_scale", ids)

    def to_dask(self):  # -> dask.array.Array (dask is optional)
        """Lazy dask array [C, D] of true float32 values. Rows of shards not done (at the time
        of this call) are NaN; a corrupt chunk raises zarr's checksum ValueError on compute."""
        return self._reader.to_dask()

    def consolidation_problems(self) -> list[str]:
        """Why the consolidated metadata of a format-3 store is not current (missing, or stale
        for some arrays); empty when it is, and for formats 1 and 2 (they have none)."""
        return consolidated_problems(self._loc) if self.format_version >= 3 else []

    def to_xarray(self):  # -> xarray.Dataset (xarray is optional)
        """Lazy xarray Dataset of true float32 values whatever the stored dtype, with the
        coordinates of format 3 (also for older stores): see ``classgrad.open_dataset``."""
        from classgrad.store.rows.dataset import store_dataset

        done = self.shard_done  # one read: the rows' NaNs and the shard_done variable agree
        return store_dataset(
            self._arrays,
            self.spec,  # with format 4's class names, read from their array
            self._reader.to_dask(done),
            done=done,
            version=self.format_version,
            similarity=self.similarity_info(),
        )

    # ----------------------------------------------------------------- verification

    def scan_chunks(self, *, progress: bool | None = False) -> list[ChunkProblem]:
        """Read every chunk of every array once, results included; one ``ChunkProblem`` per
        problem, with its kind (see ``classgrad.store.scan.scan_chunks``; ``progress``: a bar,
        as ``progress_bar``'s ``show``)."""
        checking = self.check_digests
        self.check_digests = False  # the scan checks the records itself, and reports every problem
        self._checking.fetched = {}  # the digests of what it reads, checked against the records
        try:
            return scan_chunks(
                self._arrays,
                self._spec,
                self.similarity_arrays,
                records=self.format_version >= 2,
                generation=self.generation,
                fetched=self._checking.fetched,
                progress=progress,
            )
        finally:
            self._checking.fetched = None
            self.check_digests = checking

    def verify_chunks(self) -> list[str]:
        """Read every chunk of every array; return one line per problem (empty when sound):
        the messages of ``scan_chunks`` (corrupt or unreadable chunks, chunks missing from
        shards marked done, non-finite or invalid values, shard_done values other than 0/1)."""
        return [p.message for p in self.scan_chunks()]

    # ----------------------------------------------------------------- similarity (readers)
    # The reader API of docs/reading.md; ``similarity_arrays`` also writes them.

    def similarity_info(self) -> dict | None:
        """Attributes of the stored similarity matrix, or None (``SimilarityArrays.info``)."""
        return self.similarity_arrays.info()

    def similarity(self, ids: Any = None, cols: Any = None) -> np.ndarray:
        """Rows ``ids`` (default all) and columns ``cols`` (default all) of the stored class
        similarity matrix, float32; refused unless a finished result of these rows exists."""
        return self.similarity_arrays.matrix(ids, cols)

    def similarity_neighbours(self, ids: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k neighbours of rows ``ids`` (default all): (row indices int64 [n, k], values
        float32 [n, k]), most similar first, self excluded; row i is class ``class_ids[i]``."""
        return self.similarity_arrays.neighbours(ids)
