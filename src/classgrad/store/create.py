"""Creating and opening stores: the two ways to get a ``GradStore``.

Holds ``create_store`` (driver only, under the store's lease: create the group, arrays and
attributes once, or reopen a store of the same config to resume, or replace it when asked,
finishing first any deletion that an interrupted overwrite left) and ``open_store`` (workers
with ``mode="r+"``, readers with ``mode="r"``) and ``open_dataset`` (a reader's lazy xarray
Dataset of true values).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Literal

import numpy as np
import zarr
from zarr.codecs import BytesCodec

from classgrad.errors import ClassgradError, StoreError, StoreMismatchError, first_line
from classgrad.store.core.coords import array_attributes, consolidate, coordinates_attr, write_coordinates
from classgrad.store.core.encoding import BF16_NAN
from classgrad.store.core.format import (
    ARRAY_DIMS,
    ATTR_KEY,
    COORDINATES_ATTR,
    DELETING_SUFFIX,
    OVERWRITE_HINT,
    STORAGE_DTYPES,
    StoreSpec,
    array_table,
    check_same,
    codecs,
    spec_to_meta,
)
from classgrad.store.core.location import Location, probe
from classgrad.store.grad_store import GradStore
from classgrad.store.integrity.lease import HeldLease, StoreLease
from classgrad.store.integrity.shard_records import RECORDS_DIR
from classgrad.store.store_keys import delete_store_keys, list_keys

log = logging.getLogger(__name__)

# Why a deletion was started (written into the deletion marker): only one that replaced a
# half-created store may be finished by a run that did not ask for an overwrite.
_HALF_CREATED = "half-created"


def create_store(
    url: str,
    spec: StoreSpec,
    *,
    storage_options: dict | None = None,
    overwrite: bool = False,
    recompute: bool = False,
    lease: HeldLease | None = None,
) -> GradStore:
    """Driver only: create the store (group, arrays, attributes, once) or reopen it to resume.

    An existing store with the same fingerprint is reopened and nothing is rewritten (also with
    ``overwrite=True``); one with another fingerprint raises ``StoreMismatchError``, unless
    ``overwrite=True``: then it is deleted and a new one created. ``recompute=True`` deletes a
    store of the same fingerprint too. Only the keys a classgrad store holds are ever deleted;
    a location holding anything else (and no store) is never touched.

    ``lease`` is the caller's ``HeldLease`` on this store (a driver takes it before anything
    else, ``store_lease(url).hold(run_id)``); without one, a lease is taken for the creation alone.
    """
    if not isinstance(spec, StoreSpec):
        raise StoreError(f"create_store needs a StoreSpec, got {type(spec).__name__}")
    loc = Location(url, storage_options)
    loc.refuse_link()  # an overwrite through a link deleted the store it points to
    if lease is None:
        with StoreLease(loc, writable=True).hold(f"create-{uuid.uuid4().hex[:8]}") as own:
            return _create_or_reopen(loc, spec, overwrite, recompute, own)
    if lease.url != url:
        raise StoreError(f"create_store: the lease given is the lease of {lease.url}, not of {url}")
    lease.confirm()  # LeaseHeldError unless the caller still holds it
    return _create_or_reopen(loc, spec, overwrite, recompute, lease)


def _create_or_reopen(loc: Location, spec: StoreSpec, overwrite: bool, recompute: bool, lease: HeldLease) -> GradStore:
    url = loc.url
    marker = _read_marker(loc)
    if marker is not None:
        reason = marker.get("reason")
        if not (overwrite or recompute or reason == _HALF_CREATED):
            raise StoreError(
                f"store {url} was being deleted ({reason}, run {marker.get('run_id')!r}) when its run stopped; "
                f"rerun with {OVERWRITE_HINT} to finish the deletion and create a new store"
            )
        log.warning("store %s: finishing the deletion that run %r started (%s)", url, marker.get("run_id"), reason)
        _delete(loc, lease, str(reason))
        _create(loc, spec)
        return _created(loc, spec)
    state, meta = probe(loc)
    if state == "other":
        keys = list_keys(loc)
        if not keys.others:  # nothing but the keys of a store without its group metadata
            state = "leftovers" if keys.store else "empty"
    if state == "other":
        raise StoreError(
            f"{url} already holds something that is not a classgrad store; "
            f"refusing to write there (choose another store.url)"
        )
    if state == "leftovers":
        if not overwrite:
            raise StoreError(
                f"{url} holds chunks of a classgrad store but no store metadata (a deletion or a creation "
                f"that did not finish); rerun with {OVERWRITE_HINT} to delete them"
            )
        log.warning("overwrite: deleting the leftovers of a classgrad store at %s", url)
        _delete(loc, lease, "leftovers")
    elif state == "ready":
        assert meta is not None  # probe gives the metadata of a ready store
        try:
            check_same(meta, spec, url)
        except StoreMismatchError:
            if not overwrite:
                raise
            log.warning("overwrite: deleting store %s (fingerprint %s)", url, meta.get("fingerprint"))
            _delete(loc, lease, "overwrite")
        else:
            if not recompute:
                if overwrite:
                    log.info("store %s has this config's fingerprint: resuming it (recompute to start over)", url)
                log.info("reopening store %s to resume (fingerprint %s)", url, spec.fingerprint)
                return GradStore(loc, "r+")
            log.warning("recompute: deleting store %s (fingerprint %s) to compute it again", url, spec.fingerprint)
            _delete(loc, lease, "recompute")
    elif state == "creating":
        # Under the lease, so its creator is gone: no live driver is creating it.
        log.warning("store %s was left half-created by an interrupted run; recreating it", url)
        _delete(loc, lease, _HALF_CREATED)
    _create(loc, spec)
    return _created(loc, spec)


def _created(loc: Location, spec: StoreSpec) -> GradStore:
    log.info(
        "created store %s: %d x %d %s, %d shards of %d rows",
        loc.url,
        spec.num_classes,
        spec.dim,
        spec.dtype,
        spec.num_shards,
        spec.shard_rows,
    )
    return GradStore(loc, "r+")


def _read_marker(loc: Location) -> dict | None:
    try:
        data = loc.fs.cat_file(loc.sibling(DELETING_SUFFIX))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreError(f"cannot read {loc.url}: {first_line(exc, with_type=True)}") from None
    try:
        marker = json.loads(data)
    except ValueError:
        marker = None
    return marker if isinstance(marker, dict) else {"reason": "unknown"}


def _delete(loc: Location, lease: HeldLease, reason: str) -> None:
    """Delete the store's keys under a marker next to it, so that a deletion cut short is
    recognised (and finished) by the next run instead of leaving an unusable location."""
    marker = loc.sibling(DELETING_SUFFIX)
    try:
        loc.fs.pipe_file(marker, json.dumps({"run_id": lease.run_id, "reason": reason, "time": time.time()}).encode())
        others = delete_store_keys(loc, lease.keep_alive)
        loc.fs.rm_file(marker)
    except ClassgradError:
        raise
    except OSError as exc:
        raise StoreError(f"cannot delete the old store at {loc.url}: {first_line(exc, with_type=True)}") from None
    if others:
        shown = ", ".join(others[:3]) + (" ..." if len(others) > 3 else "")
        log.warning("store %s: left %d other file(s) there untouched: %s", loc.url, len(others), shown)


def open_store(url: str, *, storage_options: dict | None = None, mode: Literal["r", "r+"] = "r") -> GradStore:
    """Open an existing store: ``mode="r"`` for readers, ``mode="r+"`` for workers."""
    if mode not in ("r", "r+"):
        raise StoreError(f"open_store: mode must be 'r' or 'r+', got {mode!r}")
    return GradStore(Location(url, storage_options), mode)


def open_dataset(url: str, *, storage_options: dict | None = None):  # -> xarray.Dataset (xarray is optional)
    """The store at ``url`` as a lazy xarray Dataset (dask-backed) of float32 true values
    whatever the stored dtype, with coordinates (class ids and names, parameters); stores of
    every format are read. See ``classgrad.store.rows.dataset.store_dataset``."""
    return open_store(url, storage_options=storage_options).to_xarray()


def _create(loc: Location, spec: StoreSpec) -> None:
    meta = spec_to_meta(spec)
    # Each creation of a store at this location its own: records and run entries of a run that
    # opened an earlier one (and lost it) are told apart from this one's (``shard_records.foreign``).
    meta["generation"] = uuid.uuid4().hex
    fills = {
        "grads": BF16_NAN if spec.dtype == "bfloat16" else np.nan,
        "row_scale": np.nan,
        "loss": np.nan,
        "count": -1,
        "shard_done": 0,
    }
    table = array_table(
        spec.num_classes, spec.dim, spec.row_chunk, spec.col_chunk, spec.num_shards, STORAGE_DTYPES[spec.dtype]
    )
    attrs = array_attributes(spec)
    try:
        # The group is written first with state "creating" and flipped to "ready" last, so an
        # interrupted creation is recognised (and redone) instead of trusted.
        group = zarr.create_group(loc.zarr_store(read_only=False), zarr_format=3, attributes={ATTR_KEY: meta})
        for name, (shape, chunks, dtype) in table.items():
            # Sharded stores keep one object per work shard (all its rows) per column chunk.
            shards = (spec.shard_rows, *chunks[1:]) if spec.sharded and name != "shard_done" else None
            group.create_array(
                name,
                shape=shape,
                chunks=chunks,
                shards=shards,
                dtype=dtype,
                fill_value=fills[name],
                serializer=BytesCodec(endian="little"),
                compressors=codecs(spec.codec if name != "shard_done" else "none"),
                dimension_names=ARRAY_DIMS[name],
                attributes=attrs[name],
            )
        # A Zarr group of its own, so that Zarr tools listing the store do not warn about it;
        # its records are plain JSON files that Zarr ignores.
        group.create_group(RECORDS_DIR, attributes={"classgrad": "per-shard records (plain JSON files)"})
        aux = coordinates_attr(write_coordinates(group, spec))
        meta["state"] = "ready"
        group.update_attributes({ATTR_KEY: meta, **({COORDINATES_ATTR: aux} if aux else {})})
        consolidate(loc)  # last: a store is opened by xarray in one read from its creation on
    except ClassgradError:
        raise
    except Exception as exc:
        raise StoreError(f"cannot create store at {loc.url}: {first_line(exc, with_type=True)}") from None
