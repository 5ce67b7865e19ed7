"""Digests checked on read: every chunk object a reader fetches is the one its shard's record vouches for.

Holds ``RecordedDigests`` (an object's key -> its shard and the size and digest that shard's
record holds; each record read once, when a key of its shard is first fetched; what was found
wrong, raised by ``raise_failed`` once a read is over), ``DigestCheckingStore`` (a Zarr
``WrapperStore`` around the store's own: ``get`` checks each recorded object's bytes against its
record, ``set`` leaves the size and digest of what a writer wrote for its record) and
``CheckedArray`` (a Zarr array whose reads raise what was found: for dask and xarray).

Why: a chunk's crc32c proves only that the chunk is *a* valid chunk. A valid chunk copied over
another, or written by a run that no longer owned the store, passed every reader and only
``classgrad verify`` saw it (issue 45). The record's digest binds the bytes to their key (see
``shard_records``), and a record is made from the digests of the bytes its writer wrote (never read
back after another writer may have written there), so either shows as a mismatch here; a record
written for another creation of the store (``shard_records.foreign``: a run that opened the store,
lost it, and went on) vouches for nothing. Every whole read is checked, from the bytes just read;
the cost is ``benchmarks/store_read.py``'s.

What is checked: objects of the recorded arrays (``records.RECORDED_ARRAYS``) of shards that have
a record, i.e. shards marked done (a shard's record is written just before its mark and deleted
when the mark is cleared); and every done shard a row read takes rows of must have a record
(``require``). Objects of shards without one (not done; or a format-1 store, which has no
records) are read as they are: the readers' completeness checks decide about those. A partial
read of an object (an inner chunk of a Zarr shard) fetches the whole object once to check it;
objects once checked so are not checked again by the same open store (a change after that is
caught by the next open, or by ``verify``). A failure is noted during Zarr's fetches and raised
after them: raised inside, it would leave the read's other fetches pending, which the process
reports on its way out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import numpy as np
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

from classgrad.errors import CorruptChunkError
from classgrad.store.integrity.shard_records import (
    FOREIGN,
    RECORDED_ARRAYS,
    ShardRecord,
    chunk_digest,
    foreign,
    record_key,
)


class RecordedDigests:
    """The records of one store: which shard holds an object, and what its record says of it.

    ``object_rows``: rows per object of each recorded array (its Zarr shard or chunk);
    ``shard_rows``: rows per work shard."""

    def __init__(self, url: str, object_rows: dict[str, int], shard_rows: int, generation: str | None = None) -> None:
        self.url = url
        self.generation = generation  # the store's creation: a record of another is foreign
        self.object_rows = object_rows
        self.shard_rows = shard_rows
        self._records: dict[int, ShardRecord | None] = {}
        self.checked: set[str] = set()  # objects checked whole for a partial read
        self.failed: dict[str, str] = {}  # key -> what is wrong, until ``raise_failed``

    def shard_of(self, key: str) -> int | None:
        """The work shard whose rows the object ``key`` holds (None: not a recorded array's chunk)."""
        name, sep, rest = key.partition("/c/")
        rows = self.object_rows.get(name)
        if not sep or rows is None:
            return None
        try:
            first = int(rest.split("/", 1)[0])
        except ValueError:
            return None
        return first * rows // self.shard_rows

    def record(self, shard: int) -> ShardRecord | None:
        return self._records.get(shard)

    def knows(self, shard: int) -> bool:
        return shard in self._records

    def learn(self, shard: int, data: bytes | None) -> None:
        self._records[shard] = None if data is None else ShardRecord.parse(data)

    def forget(self, shard: int) -> None:
        """After the store itself changed the shard's record (marked or unmarked it)."""
        self._records.pop(shard, None)
        self.checked = {k for k in self.checked if self.shard_of(k) != shard}

    def check(self, key: str, shard: int, data: Any) -> None:
        """Note a failure unless ``data`` is what the shard's record holds at ``key``: raised by
        ``raise_failed`` once the read that fetched it is over (raised inside Zarr's fetches, it
        would leave the others of the read pending, and the process says so on its way out)."""
        record = self._records.get(shard)
        if record is None:
            return
        start = shard * self.shard_rows
        if foreign(record, self.generation):
            self.failed.setdefault(
                key,
                f"store {self.url}: shard {shard} (rows from {start}): {FOREIGN}; run `classgrad verify --repair`, "
                f"then rerun the job to recompute the shard",
            )
            return
        expected = record.chunks.get(key)
        if expected is None:  # this shard's object, which its record does not list: it vouches for nothing
            self.failed.setdefault(
                key,
                f"store {self.url}: chunk {key} of shard {shard} (rows from {start}) is not in its shard record "
                f"(the record covers less than its shard); run `classgrad verify --repair`, then rerun the job "
                f"to recompute the shard",
            )
            return
        size, digest = expected
        if len(data) != size or chunk_digest(key, (data,), record.digest) != digest:
            self.failed.setdefault(
                key,
                f"store {self.url}: chunk {key} of shard {shard} (rows from {start}) is not the one its shard "
                f"record holds ({len(data)} bytes, record {size}; changed or copied after the shard was done); "
                f"run `classgrad verify --repair`, then rerun the job to recompute the shard",
            )

    def check_missing(self, key: str, shard: int) -> None:
        """Note a failure when the shard's record lists ``key``, whose object is gone."""
        record = self._records.get(shard)
        if record is None or key not in record.chunks or foreign(record, self.generation):
            return
        self.failed.setdefault(
            key,
            f"store {self.url}: chunk {key} of shard {shard} (rows from {shard * self.shard_rows}) is missing, "
            f"though its shard record lists it; run `classgrad verify --repair`, then rerun the job to recompute "
            f"the shard",
        )

    def require(self, shards: Iterable[int]) -> None:
        """Note a failure for each of ``shards`` (marked done, just read) that has no readable
        record: a format-2 store vouches for a done shard's rows by its record."""
        for shard in shards:
            if shard in self._records and self._records[shard] is None:
                self.failed.setdefault(
                    f"shard_records/{shard}",
                    f"store {self.url}: shard {shard} (rows from {shard * self.shard_rows}) is marked done but its "
                    f"record is missing or unreadable; run `classgrad verify --repair`, then rerun the job",
                )

    def raise_failed(self) -> None:
        """Raise ``CorruptChunkError`` for the objects found unlike their records since the last call."""
        if not self.failed:
            return
        keys = sorted(self.failed)
        message = self.failed[keys[0]]
        self.failed.clear()
        more = f" ({len(keys) - 1} more chunks unlike their records)" if len(keys) > 1 else ""
        raise CorruptChunkError(message + more)


class DigestCheckingStore(WrapperStore[Store]):
    """A Zarr store whose reads of recorded chunk objects are checked against their records."""

    def __init__(self, store: Store, digests: RecordedDigests | None = None) -> None:
        super().__init__(store)
        self.digests = digests
        # Where writes of recorded objects leave their size and digest (``writer.RowWriter.written``).
        self.written: dict[str, tuple[int, str]] | None = None
        # Objects a writer is replacing whole (``writer.RowWriter.replacing``): zarr's sharding
        # codec reads a shard object to merge a write into it, a request per object (a GET, or a
        # HEAD and a LIST) that a write of the whole shard does not need; it reads "missing" here.
        self.replacing: set[str] = set()
        # Where whole reads of recorded objects leave their size and digest (``scan.scan_chunks``:
        # ``classgrad verify`` checks the records against the bytes its scan read, once).
        self.fetched: dict[str, tuple[int, str]] | None = None

    def _with_store(self, store: Store) -> DigestCheckingStore:
        out = type(self)(store, self.digests)
        out.written = self.written
        out.replacing = self.replacing
        out.fetched = self.fetched
        return out

    async def set(self, key: str, value: Buffer) -> None:
        await self._store.set(key, value)
        if self.written is not None and key.partition("/c/")[0] in RECORDED_ARRAYS:
            data = value.as_numpy_array()
            self.written[key] = (len(data), chunk_digest(key, (data,)))

    async def _recorded_shard(self, key: str, prototype: BufferPrototype) -> int | None:
        """The work shard of the recorded object ``key`` (None: not one, or no check), its record
        read first when this store has not yet."""
        digests = self.digests
        shard = None if digests is None else digests.shard_of(key)
        if digests is None or shard is None:
            return None
        if not digests.knows(shard):
            found = await self._store.get(record_key(shard), prototype)
            digests.learn(shard, None if found is None else found.to_bytes())
        return shard

    async def _check(self, key: str, prototype: BufferPrototype, data: Buffer) -> None:
        """Note (``RecordedDigests.check``) whether ``data``, the whole object ``key``, is what its
        shard's record holds."""
        shard = await self._recorded_shard(key, prototype)
        if shard is not None and self.digests is not None:
            self.digests.check(key, shard, data.as_numpy_array())  # a view of the bytes read: no copy

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        if key in self.replacing:
            return None
        if byte_range is not None:  # part of an object: the whole of it checked once
            await self._check_whole(key, prototype)
            return await self._store.get(key, prototype, byte_range)
        buf = await self._store.get(key, prototype)
        if buf is None:
            await self._check_missing(key, prototype)
        else:
            await self._check(key, prototype, buf)
            if self.fetched is not None and key.partition("/c/")[0] in RECORDED_ARRAYS:
                data = buf.as_numpy_array()
                self.fetched[key] = (len(data), chunk_digest(key, (data,)))
        return buf

    async def _check_missing(self, key: str, prototype: BufferPrototype) -> None:
        """Note a failure when ``key`` is gone although its shard's record lists it: zarr would
        read the fill value (a count of -1, a NaN loss) for rows the store calls done."""
        shard = await self._recorded_shard(key, prototype)
        if shard is not None and self.digests is not None:
            self.digests.check_missing(key, shard)

    async def _check_whole(self, key: str, prototype: BufferPrototype) -> None:
        digests = self.digests
        if digests is None or key in digests.checked or digests.shard_of(key) is None:
            return
        whole = await self._store.get(key, prototype)
        if whole is not None:
            await self._check(key, prototype, whole)
            digests.checked.add(key)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        ranges = list(key_ranges)
        if any(key in self.replacing for key, _ in ranges):
            return [None if key in self.replacing else await self.get(key, prototype, r) for key, r in ranges]
        await asyncio.gather(*(self._check_whole(key, prototype) for key in {k for k, _ in ranges}))
        return await self._store.get_partial_values(prototype, ranges)


class CheckedArray:
    """A Zarr array whose every read raises what ``RecordedDigests`` found unlike its records
    (what ``dask.array.from_array`` takes for ``to_dask`` and ``to_xarray``). ``done``: the
    shards' done flags as the reader took them: a read of a done shard without a record is
    refused too, as ``rows()`` refuses it (a chunk copied in with its record deleted read as
    another row's data)."""

    def __init__(self, array: Any, digests: RecordedDigests | None, done: np.ndarray | None = None) -> None:
        self.array, self.digests, self.done = array, digests, done
        self.shape, self.dtype, self.ndim = array.shape, array.dtype, array.ndim

    def __getitem__(self, selection: Any) -> Any:
        out = self.array[selection]
        if self.digests is not None:
            if self.done is not None:
                self.digests.require(self._done_shards(selection))
            self.digests.raise_failed()
        return out

    def _done_shards(self, selection: Any) -> list[int]:
        assert self.digests is not None and self.done is not None
        rows = selection[0] if isinstance(selection, tuple) and selection else selection
        n = self.shape[0]
        if isinstance(rows, slice):
            start, stop, _ = rows.indices(n)
            ids = np.arange(start // self.digests.shard_rows, -(-stop // self.digests.shard_rows))
        else:
            ids = np.unique(np.arange(n)[rows] // self.digests.shard_rows)
        return [int(s) for s in ids if s < len(self.done) and self.done[s]]


def object_rows(arrays: Any) -> dict[str, int]:
    """Rows per object of each recorded array of an open store (``StoreArrays``)."""
    return {name: int((arrays[name].shards or arrays[name].chunks)[0]) for name in RECORDED_ARRAYS}
