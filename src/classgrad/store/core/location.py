"""Where a store lives: a local directory or an fsspec URL, and what is found there.

Holds ``local_path`` (the path part of a local store URL), ``Location`` (the Zarr store object
of a URL plus an fsspec view of it, for the lease and for chunk objects; ``sibling`` names the
keys kept next to the store) and ``probe`` (what is at a location: nothing, something else, a
half-created store or a ready one; ``create`` tells a store's leftovers from something else).

Locations: a plain path or ``file://`` (Zarr ``LocalStore``), ``s3://bucket/path`` through
fsspec/s3fs with ``storage_options`` (``endpoint_url`` or ``client_kwargs``; credentials from
the environment or the options, never stored), ``memory://`` for tests.
"""

from __future__ import annotations

import functools
import inspect
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec
import zarr
from zarr.abc.store import Store
from zarr.storage import FsspecStore, LocalStore

from classgrad.errors import StoreError, first_line
from classgrad.store.core.format import ATTR_KEY

# Connections of a store's S3 client: fsspec sends a batch of reads (1,280 at a time) at once.
S3_CONNECTIONS = 256


def local_path(url: str) -> str | None:
    """The raw path part of a local store URL (``file://PATH`` or a plain path), as given (not
    expanded nor made absolute); None for any other scheme (``s3://``, ``memory://``...)."""
    if "://" in url and not url.startswith("file://"):
        return None
    return url[len("file://") :] if url.startswith("file://") else url


class Location:
    """Where a store lives: the Zarr store object plus an fsspec view for the lease and chunk keys."""

    def __init__(self, url: str, storage_options: dict | None) -> None:
        if not isinstance(url, str) or not url:
            raise StoreError(f"store url must be a non-empty string, got {url!r}")
        self.url = url
        self.options = dict(storage_options or {})
        path = local_path(url)
        self.local = path is not None
        self.path: str
        if path is not None:
            self.path = os.path.abspath(os.path.expanduser(path))
            self.fs = fsspec.filesystem("file")
        else:
            try:
                self.fs, self.path = fsspec.core.url_to_fs(url, **self._fs_options)
            except (ImportError, ValueError, TypeError) as exc:
                raise StoreError(f"cannot use store location {url}: {first_line(exc, with_type=True)}") from None
            self.path = self.path.rstrip("/")

    def zarr_store(self, *, read_only: bool) -> Store:
        if self.local:
            return LocalStore(self.path, read_only=read_only)
        return FsspecStore.from_url(self.url, storage_options=self._fs_options or None, read_only=read_only)

    @property
    def _fs_options(self) -> dict[str, Any]:
        """The filesystem's options: the user's, and on S3, unless the user chose otherwise, one
        GET per whole-object read (s3fs's concurrent reads of large objects first ask for the
        object's size, a HEAD and, when it is missing, a LIST: zarr's read of a chunk before it
        writes one cost 3 requests instead of 1) and ``S3_CONNECTIONS`` connections (botocore's
        10 would hold a read of 125,000 small objects, a resume at 62,500 shards, to 10 at a
        time: 250 s at 20 ms a request)."""
        if self.url.split("://", 1)[0].lower() not in ("s3", "s3a"):
            return self.options
        options = {"max_concurrency": 1, **self.options}
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("max_pool_connections", S3_CONNECTIONS)
        return {**options, "config_kwargs": config}

    def refuse_link(self) -> None:
        """Refuse a local store path that is a symbolic link: its lease would be the link's, not
        the store's, and an overwrite through it deleted another job's store."""
        if self.local and os.path.islink(self.path.rstrip("/")):
            raise StoreError(
                f"store url {self.url} is a symbolic link (to {os.path.realpath(self.path)}): give the real "
                "path, so that the store's lease and any overwrite apply to the store itself"
            )

    def key(self, name: str) -> str:
        return f"{self.path}/{name}"

    def sibling(self, suffix: str) -> str:
        """The path of a key next to the store (its lease, its deletion marker), outside what
        deleting the store removes; a store at a bucket's root keeps them under the root."""
        if self.local or "/" in self.path.strip("/"):
            return f"{self.path.rstrip('/')}{suffix}"
        return f"{self.path}/{suffix}"

    def read_bytes(self, name: str) -> bytes | None:
        """The object ``name`` (relative to the store), or None when there is none."""
        try:
            return self.fs.cat_file(self.key(name), **self._one_request)
        except FileNotFoundError:
            return None

    def read_many(self, names: Sequence[str]) -> list[bytes | None]:
        """The objects ``names`` (relative to the store), None for each one that is not there:
        locally one plain read each (fsspec's per-file overhead is most of the time of small
        objects), elsewhere batched requests (fsspec's ``cat``: concurrent on object storage)."""
        if self.local:
            out: list[bytes | None] = []
            for name in names:
                try:
                    with open(f"{self.path}/{name}", "rb") as fh:
                        out.append(fh.read())
                except FileNotFoundError:
                    out.append(None)
            return out
        paths = [self.key(name) for name in names]
        found = self.fs.cat(paths, on_error="return", **self._one_request) if paths else {}
        if not isinstance(found, dict):  # one path: fsspec returns its bytes
            found = {paths[0]: found}
        result: list[bytes | None] = []
        for path in paths:
            value = found.get(path, FileNotFoundError(path))
            if isinstance(value, FileNotFoundError):
                result.append(None)
            elif isinstance(value, BaseException):
                raise value
            else:
                result.append(bytes(value))
        return result

    @functools.cached_property
    def _one_request(self) -> dict[str, Any]:
        """The options that make a whole-object read one GET: s3fs, with its concurrent reads of
        large objects on, first asks for the object's size (a HEAD, or a cached listing that may
        predate the object: a mark written since then would read as missing)."""
        try:
            takes = "max_concurrency" in inspect.signature(self.fs._cat_file).parameters
        except (AttributeError, TypeError, ValueError):
            takes = False
        return {"max_concurrency": 1} if takes else {}

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write the object ``name`` whole: one PUT on object storage; locally, a temporary file
        renamed over it, so that a reader never sees half a file."""
        if self.local:
            tmp = f"{self.key(name)}.{uuid.uuid4().hex}.partial"
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, self.key(name))
        else:
            self.fs.pipe_file(self.key(name), data)

    def write_many(self, objects: Mapping[str, bytes]) -> None:
        """Write each object of ``objects`` (name -> bytes) whole: locally as ``write_bytes``,
        elsewhere in one batch of PUTs (fsspec's ``pipe``: concurrent on object storage)."""
        if self.local:
            for name, data in objects.items():
                self.write_bytes(name, data)
        elif objects:
            self.fs.pipe({self.key(name): data for name, data in objects.items()})

    def list_folder(self, folder: str) -> list[str]:
        """The objects directly in ``folder`` (keys relative to the store; none when it is
        absent): one listing."""
        if self.local:
            try:
                return [f"{folder}/{e.name}" for e in os.scandir(self.key(folder)) if e.is_file()]
            except FileNotFoundError:
                return []
        self.fs.invalidate_cache(self.key(folder))  # s3fs caches listings: a new object must show
        try:
            found = self.fs.ls(self.key(folder), detail=False)
        except FileNotFoundError:
            return []
        return [f"{folder}/{path.rstrip('/').rsplit('/', 1)[-1]}" for path in found]

    def delete(self, name: str) -> None:
        """Remove the object ``name`` (relative to the store), if it is there."""
        try:
            self.fs.rm_file(self.key(name))
        except FileNotFoundError:
            pass

    def is_empty(self) -> bool:
        if self.local:
            return not os.path.exists(self.path) or (os.path.isdir(self.path) and not os.listdir(self.path))
        self.fs.invalidate_cache()  # s3fs caches listings; a stale one could hide data
        try:
            return not self.fs.ls(self.path)
        except FileNotFoundError:
            return True

    def why_absent(self) -> str:
        """Why nothing was found: a missing bucket is worth naming."""
        bucket = self.path.split("/", 1)[0]
        if not self.local and bucket:
            try:
                if not self.fs.exists(bucket):
                    return f"bucket {bucket!r} does not exist"
            except OSError:
                pass
        return "no Zarr group there"


def unreadable(url: str, what: str, exc: BaseException) -> StoreError:
    """The one line for a metadata document of a store that cannot be parsed (truncated or garbled)."""
    return StoreError(f"store at {url}: {what} cannot be read ({first_line(exc)}); it is damaged")


def probe(loc: Location) -> tuple[str, dict | None]:
    """What is at a location: 'empty', 'other', 'creating' or 'ready' (+ classgrad metadata)."""
    try:
        group = zarr.open_group(loc.zarr_store(read_only=True), mode="r", zarr_format=3, use_consolidated=False)
    except FileNotFoundError:  # also zarr's GroupNotFoundError
        return ("empty" if loc.is_empty() else "other"), None
    except (zarr.errors.ContainsArrayError, zarr.errors.NodeTypeValidationError):
        return "other", None
    except ValueError as exc:  # a truncated or garbled zarr.json
        raise unreadable(loc.url, "zarr.json", exc) from None
    except Exception as exc:
        raise StoreError(f"cannot read store location {loc.url}: {first_line(exc, with_type=True)}") from None
    meta = group.attrs.get(ATTR_KEY)
    if not isinstance(meta, dict):
        return "other", None
    return ("ready" if meta.get("state") == "ready" else "creating"), meta
