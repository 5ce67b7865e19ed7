"""Atomic lease files: create only if absent, replace or delete only if unchanged, per storage.

Holds ``lease_file`` (the ``LeaseFile`` of one key outside a store, chosen by its filesystem)
and its three kinds, each offering ``read`` -> (bytes or None, version), ``create(data)``,
``replace(data, version)`` and ``delete(version)``; the last three return False when another
writer got there first (the version read is no longer the current one):

- ``LocalLeaseFile``: every change under an fcntl lock (``flock``) of a sibling lock file, so
  that read-compare-write is one step between processes (the lock file is removed with the
  lease, so none is left beside a deleted store); creation is exclusive (``link`` of a
  complete temporary file, which fails if the name exists, as ``O_CREAT|O_EXCL`` does, and
  shows readers a whole file; ``O_CREAT|O_EXCL`` where links are not supported).
- ``S3LeaseFile``: conditional PUTs (``If-None-Match: *`` creates only if absent, ``If-Match:
  <ETag>`` replaces only if unchanged; a lost race is HTTP 412, or 409 while another
  conditional write is in flight) and an ``If-Match`` DELETE.
- ``PlainLeaseFile``: any other fsspec filesystem (no conditional writes): write, then read
  back, best effort; said once in the log.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any, Protocol

from fsspec.asyn import sync

log = logging.getLogger(__name__)


class LeaseFile(Protocol):
    def read(self) -> tuple[bytes | None, Any]: ...

    def create(self, data: bytes) -> bool: ...

    def replace(self, data: bytes, version: Any) -> bool: ...

    def delete(self, version: Any) -> bool: ...


def lease_file(fs: Any, path: str, *, local: bool, lock_path: str) -> LeaseFile:
    """The lease file at ``path`` on ``fs``: local, S3 (conditional writes) or best effort."""
    if local:
        return LocalLeaseFile(path, lock_path)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("s3", "s3a") and hasattr(fs, "_call_s3"):
        return S3LeaseFile(fs, path)
    _warn_best_effort(protocol)
    return PlainLeaseFile(fs, path)


_warned: set[str] = set()


def _warn_best_effort(protocol: str) -> None:
    if protocol not in _warned:
        _warned.add(protocol)
        log.info(
            "%s:// offers no conditional writes: the store's lease there is best effort (write, read back)", protocol
        )


class LocalLeaseFile:
    """A lease file on a local (or POSIX-locking network) filesystem."""

    def __init__(self, path: str, lock_path: str) -> None:
        self.path = path
        self.lock_path = lock_path

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the lock file's flock. ``delete`` removes the lock file (no ``.lock`` is left
        beside a store once its lease is gone), so a lock taken on a file that was removed while
        waiting for it is dropped and taken again on the file now at the path: every holder
        holds the one file there is."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # released when the file is closed
                try:
                    current = os.stat(self.lock_path).st_ino
                except FileNotFoundError:
                    current = None
                if current != os.fstat(fd).st_ino:
                    continue  # removed (or replaced) while we waited: lock the one there now
                yield
                return
            finally:
                os.close(fd)

    def _read(self) -> bytes | None:
        try:
            with open(self.path, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None

    def _temporary(self, data: bytes) -> str:
        tmp = f"{self.path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        return tmp

    def read(self) -> tuple[bytes | None, Any]:
        data = self._read()
        return data, data

    def create(self, data: bytes) -> bool:
        with self._locked():
            tmp = self._temporary(data)
            try:
                os.link(tmp, self.path)
                return True
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                return self._create_exclusive(data)
            finally:
                os.remove(tmp)

    def _create_exclusive(self, data: bytes) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        return True

    def replace(self, data: bytes, version: Any) -> bool:
        with self._locked():
            if self._read() != version or version is None:
                return False
            os.replace(self._temporary(data), self.path)  # readers see the old file or the new one
            return True

    def delete(self, version: Any) -> bool:
        with self._locked():
            if self._read() != version or version is None:
                return False
            os.remove(self.path)
            # The lock file goes too, while still held: a waiter then finds it gone and locks a
            # new one (``_locked``).
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.lock_path)
            return True


def _lost_race(exc: BaseException, *, matching: bool) -> bool:
    """True when S3 refused a conditional request: its precondition failed (412), another
    conditional write was in flight (409), or (``matching``: an If-Match request) the object
    it was to match is gone (404; when creating, a 404 is a missing bucket, not a race)."""
    if isinstance(exc, FileExistsError) or (matching and isinstance(exc, FileNotFoundError)):
        return True
    cause = exc.__cause__
    response = getattr(cause, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


class S3LeaseFile:
    """A lease object on S3 (or an S3-compatible server with conditional writes)."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.bucket, _, self.key = path.partition("/")

    def read(self) -> tuple[bytes | None, Any]:
        async def get() -> tuple[bytes | None, Any]:
            try:
                response = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
            except FileNotFoundError:
                return None, None
            body = await response["Body"].read()
            return body, response["ETag"]

        return sync(self.fs.loop, get)

    def _call(self, method: str, **kwargs: Any) -> bool:
        try:
            self.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)
        except OSError as exc:
            if _lost_race(exc, matching="IfMatch" in kwargs):
                return False
            raise
        return True

    def create(self, data: bytes) -> bool:
        return self._call("put_object", Body=data, IfNoneMatch="*")

    def replace(self, data: bytes, version: Any) -> bool:
        return version is not None and self._call("put_object", Body=data, IfMatch=version)

    def delete(self, version: Any) -> bool:
        return version is not None and self._call("delete_object", IfMatch=version)


class PlainLeaseFile:
    """A lease file on a filesystem without conditional writes: best effort."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.path = path

    def read(self) -> tuple[bytes | None, Any]:
        try:
            data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None, None
        return data, data

    def create(self, data: bytes) -> bool:
        if self.read()[0] is not None:
            return False
        self.fs.pipe_file(self.path, data)
        return self.read()[0] == data

    def replace(self, data: bytes, version: Any) -> bool:
        if version is None or self.read()[0] != version:
            return False
        self.fs.pipe_file(self.path, data)
        return self.read()[0] == data

    def delete(self, version: Any) -> bool:
        if version is None or self.read()[0] != version:
            return False
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path)
        return True
