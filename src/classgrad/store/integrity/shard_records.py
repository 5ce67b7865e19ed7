"""Per-shard records and the metadata digest (store format 2): what a done shard vouches for.

Holds the record keys (``record_key``), ``chunk_digest`` (a digest of a chunk object's bytes,
bound to its key), ``shard_chunk_keys`` (the objects that hold a work shard's rows),
``ShardRecord`` (one shard's chunks: key -> size and digest, and the store's generation it was
written for; ``to_bytes`` / ``parse``), ``foreign`` (a record of another creation of the store),
``list_sizes`` (every key of a store with its size, from one listing), ``record_problems``
(a done shard's recorded chunks checked against that listing: the cheap check of a resume)
and ``sync_paths`` / ``sync_dir`` (fsync of local files and directories, the durability step
before ``shard_done``). The metadata digest is in ``format``.

A record is written (``shard_records/<shard>.json``, plain JSON, readers of the arrays ignore
it) just before its shard's ``shard_done`` mark, so a done shard of a format-2 store always has
one. Digests are xxh3-128 (blake2b-128 in records made before) over the key, a NUL byte and the
object's bytes (``DIGEST``: why not a CRC).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from classgrad.store.core.location import Location

RECORDS_DIR = "shard_records"
# Digests by the name a record gives: new records take the first (about 30x blake2b's speed here,
# so checking every read costs little: ``benchmarks/store_read.py``); records made before name
# blake2b. Neither is a CRC: a valid chunk ends with the crc32c of its own bytes, and crc32c over
# such an object is the same for every valid chunk of one size (a chunk copied over another would
# pass). Corruption and copies are what they detect; no one forges a chunk here.
XXH3 = "xxh3-128 of key, NUL, object bytes"
BLAKE2B = "blake2b-128 of key, NUL, object bytes"
DIGEST = XXH3
_HASHES: dict[str, Callable[[bytes], Any]] = {
    XXH3: xxhash.xxh3_128,
    BLAKE2B: lambda prefix: hashlib.blake2b(prefix, digest_size=16),
}
# The per-row arrays whose chunks a shard record covers (``shard_done`` itself is the mark).
RECORDED_ARRAYS = ("grads", "row_scale", "loss", "count")


def record_key(shard: int) -> str:
    return f"{RECORDS_DIR}/{int(shard)}.json"


def chunk_digest(key: str, data: Iterable[Any], name: str = DIGEST) -> str:
    """The digest ``name`` of a chunk object made of the byte strings (or buffers) ``data``, in
    order, stored at ``key``."""
    h = _HASHES[name](key.encode() + b"\0")
    for part in data:
        h.update(part)
    return str(h.hexdigest())


def values_digest(place: str, values: Any) -> str:
    """The digest of a chunk's values (a numpy array) bound to ``place`` (what names where they
    belong: the array, the window or run, the chunk's index), their dtype and shape: the records
    of the training log and of the analysis outputs. The bytes are hashed as they are, no copy."""
    arr = np.ascontiguousarray(values)
    return chunk_digest(f"{place}\0{arr.dtype.str}{arr.shape}", (arr.reshape(-1).view(np.uint8),))


def known_digest(name: str) -> bool:
    return name in _HASHES


def shard_chunk_keys(name: str, rows: tuple[int, int], object_shape: tuple[int, ...], shape: tuple[int, ...]) -> list:
    """Keys of the objects of array ``name`` (of ``shape``, one object per ``object_shape``:
    the chunk, or the Zarr shard when sharded) that hold rows [start, stop)."""
    start, stop = rows
    r = object_shape[0]
    row_idx = range(start // r, -(-stop // r))
    if len(shape) == 1:
        return [f"{name}/c/{i}" for i in row_idx]
    cols = -(-shape[1] // object_shape[1])
    return [f"{name}/c/{i}/{j}" for i in row_idx for j in range(cols)]


@dataclass
class ShardRecord:
    """One done shard's chunk objects: key -> (size in bytes, digest)."""

    shard: int
    rows: tuple[int, int]
    chunks: dict[str, tuple[int, str]] = field(default_factory=dict)
    generation: str | None = None  # the store's, when it has one: which creation of it the rows are of
    digest: str = DIGEST  # the name of the digest its chunks' digests are

    def to_bytes(self) -> bytes:
        body = {
            "shard": self.shard,
            "rows": list(self.rows),
            "digest": self.digest,
            "chunks": {k: [size, digest] for k, (size, digest) in sorted(self.chunks.items())},
        }
        if self.generation is not None:
            body["generation"] = self.generation
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, data: bytes) -> ShardRecord | None:
        """The record in ``data``, or None when it is not a readable record."""
        try:
            body = json.loads(data)
            chunks = {str(k): (int(v[0]), str(v[1])) for k, v in body["chunks"].items()}
            generation = body.get("generation")
            rows = (int(body["rows"][0]), int(body["rows"][1]))
            digest = str(body.get("digest", BLAKE2B))
            if not known_digest(digest):
                return None
            return cls(int(body["shard"]), rows, chunks, None if generation is None else str(generation), digest)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return None


def list_sizes(loc: Location) -> dict[str, int]:
    """Every object of the store (key relative to its root) with its size: one listing."""
    sizes: dict[str, int] = {}
    if loc.local:
        stack = [(loc.path, "")]  # a folder and its key prefix (relpath per entry is most of the time)
        while stack:
            top, prefix = stack.pop()
            try:
                entries = list(os.scandir(top))
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, f"{prefix}{entry.name}/"))
                else:
                    sizes[prefix + entry.name] = entry.stat().st_size
        return sizes
    loc.fs.invalidate_cache()  # s3fs caches listings; a stale one could hide a deletion
    prefix = loc.path.rstrip("/") + "/"
    # Each top folder (an array, the records) listed at once: a listing is a request per 1,000
    # keys, one after another, and a store of 62,500 shards holds 375,000 keys.
    top = loc.fs.ls(loc.path, detail=True)
    folders = [entry["name"] for entry in top if entry.get("type") == "directory"]
    found = {entry["name"]: entry for entry in top if entry.get("type") != "directory"}
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(folders)))) as pool:
        for listing in pool.map(lambda folder: loc.fs.find(folder, detail=True), folders):
            found.update(listing)
    for path, info in found.items():
        if path.startswith(prefix):
            sizes[path[len(prefix) :]] = int(info.get("size") or 0)
    return sizes


def foreign(record: ShardRecord, generation: str | None) -> bool:
    """Whether ``record`` was written for another creation of the store than ``generation`` (the
    store's; None: a store made before generations, whose records are taken as they are)."""
    return generation is not None and record.generation != generation


FOREIGN = "its record was written by a run that no longer owned the store (another creation of it)"


def object_keys(name: str, arr: Any, rows: tuple[int, int]) -> list[str]:
    """Keys of the objects of ``arr`` (the array ``name`` of an open store: its chunks, or its
    Zarr shards when sharded) that hold rows [start, stop)."""
    return shard_chunk_keys(name, rows, arr.shards or arr.chunks, arr.shape)


def shard_keys(arrays: Any, rows: tuple[int, int]) -> list[str]:
    """Every object key of the recorded arrays of ``arrays`` (an open store's, by name) holding
    rows [start, stop): what a shard's record must cover, and what its writer records."""
    return [key for name in RECORDED_ARRAYS for key in object_keys(name, arrays[name], rows)]


def uncovered(record: ShardRecord, expected: Iterable[str]) -> list[str]:
    """The keys of ``expected`` (``shard_keys``) the record does not list: a record that covers
    less than its shard vouches for nothing there (a chunk copied in with its key dropped)."""
    return [key for key in expected if key not in record.chunks]


def record_problems(
    record: ShardRecord | None,
    sizes: dict[str, int],
    generation: str | None = None,
    expected: Iterable[str] = (),
) -> list[str]:
    """What is wrong with a done shard's recorded chunks in a listing (empty when sound);
    ``expected``: the keys its record must cover (``shard_keys``)."""
    if record is None:
        return ["its shard record is missing or unreadable"]
    if foreign(record, generation):
        return [FOREIGN]
    out = [f"its record does not cover chunk {key}" for key in uncovered(record, expected)]
    for key, (size, _) in sorted(record.chunks.items()):
        found = sizes.get(key)
        if found is None:
            out.append(f"chunk {key} is missing")
        elif found != size:
            out.append(f"chunk {key} has {found} bytes, its record says {size}")
    return out


def sync_paths(files: Iterable[str], root: str) -> None:
    """fsync each local file, then each directory from the ones holding them up to ``root``
    (a chunk's directory may be new, so its name in its parent must be durable too)."""
    dirs: dict[str, None] = {}
    root = os.path.abspath(root)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        directory = os.path.dirname(os.path.abspath(path))
        while directory not in dirs and (directory == root or directory.startswith(root + os.sep)):
            dirs[directory] = None
            directory = os.path.dirname(directory)
    for directory in dirs:
        sync_dir(directory)


def sync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
