"""The keys a classgrad store holds, told apart from anything else at its location, and their deletion.

Holds ``is_store_key`` (a relative key a classgrad store writes: group and array ``zarr.json``,
the arrays' chunk keys (coordinates of format 3 included), the shard records, the run records
of format 4, the legacy
in-store lease, the temporary files of its atomic writes, the group's metadata's included),
``list_keys`` (the keys at a location, split into the store's and the others; the lease and
the deletion marker, siblings of the store, are neither) and ``delete_store_keys`` (delete the
store's keys, the group's ``zarr.json`` first so that nothing opens a half-deleted store, and
never any other key).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from classgrad.store.analysis.result_records import RECORDS_DIR as RESULT_RECORDS_DIR
from classgrad.store.core.format import (
    ARRAYS,
    COORD_ARRAYS,
    DELETING_SUFFIX,
    LEASE_LOCK_SUFFIX,
    LEASE_SUFFIX,
    LEGACY_LEASE_KEY,
    RUNS_DIR,
    SIM,
    SIM_INDEX,
    SIM_VALUE,
)
from classgrad.store.core.location import Location
from classgrad.store.integrity.shard_records import RECORDS_DIR

_ARRAY_NAMES = "|".join(re.escape(name) for name in (*ARRAYS, SIM, SIM_INDEX, SIM_VALUE, *COORD_ARRAYS))
_CHUNK = rf"(?:{_ARRAY_NAMES})/c(?:/\d+)+"  # Zarr v3 default chunk key encoding, "/" separated
_RECORD = rf"{re.escape(RECORDS_DIR)}/\d+\.json"  # format 2: one record per done shard
_RUN = rf"{re.escape(RUNS_DIR)}/\d{{6}}\.json"  # format 4: one record per run
_RESULT = rf"{re.escape(RESULT_RECORDS_DIR)}/[A-Za-z0-9_.-]+-\d+\.json"  # a similarity write's record
_STORE_KEY = re.compile(
    rf"^(?:zarr\.json|zarr\.json\.[0-9a-f]{{32}}\.partial|{re.escape(LEGACY_LEASE_KEY)}|\.{re.escape(LEGACY_LEASE_KEY)}\.[0-9a-f]{{32}}\.tmp"
    rf"|(?:{_ARRAY_NAMES}|{re.escape(RECORDS_DIR)})/zarr\.json|{_CHUNK}|{_CHUNK}\.[0-9a-f]{{32}}\.partial"
    rf"|{_RECORD}|{_RECORD}\.[0-9a-f]{{32}}\.partial|{_RUN}|{_RUN}\.[0-9a-f]{{32}}\.partial|{_RESULT}|{_RESULT}\.[0-9a-f]{{32}}\.partial)$"
)
# Directories a local store has (the deletion removes them once empty).
_STORE_DIR = re.compile(
    rf"^(?:(?:{_ARRAY_NAMES})(?:/c(?:/\d+)*)?|{re.escape(RECORDS_DIR)}|{re.escape(RUNS_DIR)}|{re.escape(RESULT_RECORDS_DIR)})$"
)
# A store at a bucket's root keeps its lease and marker under the root: they are not the store's.
_SIBLINGS = {LEASE_SUFFIX, LEASE_LOCK_SUFFIX, DELETING_SUFFIX}
_BATCH = 500  # keys per delete request on object storage (S3 takes at most 1000)


def is_store_key(key: str) -> bool:
    """True for a key (relative to the store) that a classgrad store writes."""
    return bool(_STORE_KEY.match(key))


@dataclass
class StoreKeys:
    """The keys at a location, relative to it."""

    store: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)


def list_keys(loc: Location) -> StoreKeys:
    """Every key at ``loc``, split into the store's keys and the others (directories a local
    store does not have count as others, so that an empty foreign directory is never taken)."""
    keys = StoreKeys()
    if loc.local:
        if not os.path.isdir(loc.path):
            return keys
        for root, dirs, files in os.walk(loc.path):
            rel_root = os.path.relpath(root, loc.path).replace(os.sep, "/")
            prefix = "" if rel_root == "." else f"{rel_root}/"
            for name in files:
                key = prefix + name
                (keys.store if is_store_key(key) else keys.others).append(key)
            for name in dirs:
                if not _STORE_DIR.match(prefix + name):
                    keys.others.append(prefix + name + "/")
        return keys
    loc.fs.invalidate_cache()  # s3fs caches listings; a stale one could hide data
    try:
        found = loc.fs.find(loc.path)
    except FileNotFoundError:
        return keys
    for path in found:
        key = path[len(loc.path) :].lstrip("/")
        if not key or key in _SIBLINGS:
            continue
        (keys.store if is_store_key(key) else keys.others).append(key)
    return keys


def delete_store_keys(loc: Location, keep_alive: Callable[[], None] = lambda: None) -> list[str]:
    """Delete the classgrad store's keys at ``loc`` (the group's ``zarr.json`` first) and return
    the other keys, left untouched. ``keep_alive`` is called between batches (the caller's
    lease renewal: deleting a large store on object storage takes a while)."""
    keys = list_keys(loc)
    order = sorted(keys.store, key=lambda k: k != "zarr.json")  # the group first: then no reader opens it
    for start in range(0, len(order), _BATCH):
        batch = order[start : start + _BATCH]
        if loc.local:
            for key in batch:
                try:
                    os.remove(os.path.join(loc.path, key))
                except FileNotFoundError:
                    pass
        else:
            loc.fs.rm([loc.key(key) for key in batch])
        keep_alive()
    if loc.local:
        _remove_empty_dirs(loc.path)
    else:
        loc.fs.invalidate_cache()
    return keys.others


def _remove_empty_dirs(top: str) -> None:
    """Remove the store's directories that the deletion left empty, then ``top`` if empty."""
    if not os.path.isdir(top):
        return
    for root, _dirs, _files in os.walk(top, topdown=False):
        rel = os.path.relpath(root, top).replace(os.sep, "/")
        if (rel == "." or _STORE_DIR.match(rel)) and not os.listdir(root):
            os.rmdir(root)
