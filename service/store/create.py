"""Creating and opening stores: the two ways to get a ``GradStore``.

Holds ``create_store`` (driver only: create the group, arrays and attributes once, or reopen a
store of the same config to resume, or replace it when asked) and ``open_store`` (workers with
``mode="r+"``, readers with ``mode="r"``).
"""

from __future__ import annotations

import logging
import time
from typing import Literal

import numpy as np
import zarr
from zarr.codecs import BytesCodec

from classgrad.service.errors import ClassgradError, LeaseHeldError, StoreError, first_line
from classgrad.service.store.encoding import BF16_NAN
from classgrad.service.store.format import (
    ARRAY_DIMS,
    ATTR_KEY,
    STORAGE_DTYPES,
    StoreSpec,
    array_table,
    check_same,
    codecs,
    spec_to_meta,
)
from classgrad.service.store.grad_store import GradStore
from classgrad.service.store.lease import held_message, lease_age, read_lease
from classgrad.service.store.location import Location, probe
from classgrad.service.store.records import RECORDS_DIR

log = logging.getLogger(__name__)


def create_store(
    url: str, spec: StoreSpec, *, storage_options: dict | None = None, overwrite: bool = False
) -> GradStore:
    """Driver only: create the store (group, arrays, attributes, once) or reopen it to resume.

    An existing store with the same fingerprint is reopened and nothing is rewritten; one with
    another fingerprint raises ``StoreMismatchError``; ``overwrite=True`` deletes it and creates
    a new one. A location holding anything that is not a classgrad store is never touched.
    """
    if not isinstance(spec, StoreSpec):
        raise StoreError(f"create_store needs a StoreSpec, got {type(spec).__name__}")
    loc = Location(url, storage_options)
    state, meta = probe(loc)
    if state == "other":
        raise StoreError(
            f"{url} already holds something that is not a classgrad store; "
            f"refusing to write there (choose another store.url)"
        )
    if state == "ready" and not overwrite:
        assert meta is not None  # probe gives the metadata of a ready store
        check_same(meta, spec, url)
        log.info("reopening store %s to resume (fingerprint %s)", url, spec.fingerprint)
        return GradStore(loc, "r+")
    if state == "ready":
        assert meta is not None
        lease, now = read_lease(loc), time.time()
        if lease and lease_age(lease, now) < float(lease.get("ttl_s", 0)):
            raise LeaseHeldError(f"cannot overwrite: {held_message(url, lease, now)}")
        log.warning("overwrite: deleting store %s (fingerprint %s)", url, meta.get("fingerprint"))
    elif state == "creating":
        log.warning("store %s was left half-created by an interrupted run; recreating it", url)
    if state != "empty":
        try:
            loc.remove_all()
        except OSError as exc:
            raise StoreError(f"cannot delete old store at {url}: {first_line(exc, with_type=True)}") from None
    _create(loc, spec)
    log.info(
        "created store %s: %d x %d %s, %d shards of %d rows",
        url,
        spec.num_classes,
        spec.dim,
        spec.dtype,
        spec.num_shards,
        spec.shard_rows,
    )
    return GradStore(loc, "r+")


def open_store(url: str, *, storage_options: dict | None = None, mode: Literal["r", "r+"] = "r") -> GradStore:
    """Open an existing store: ``mode="r"`` for readers, ``mode="r+"`` for workers."""
    if mode not in ("r", "r+"):
        raise StoreError(f"open_store: mode must be 'r' or 'r+', got {mode!r}")
    return GradStore(Location(url, storage_options), mode)


def _create(loc: Location, spec: StoreSpec) -> None:
    meta = spec_to_meta(spec)
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
            )
        # A Zarr group of its own, so that Zarr tools listing the store do not warn about it;
        # its records are plain JSON files that Zarr ignores.
        group.create_group(RECORDS_DIR, attributes={"classgrad": "per-shard records (plain JSON files)"})
        meta["state"] = "ready"
        group.update_attributes({ATTR_KEY: meta})
    except ClassgradError:
        raise
    except Exception as exc:
        raise StoreError(f"cannot create store at {loc.url}: {first_line(exc, with_type=True)}") from None
