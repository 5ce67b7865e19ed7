"""A simulated object store: an in-memory fsspec filesystem (``simstore://bucket/key``) that
answers like S3, a request at a time, each after ``latency_s``, and counts what it is asked.

Holds ``SimulatedObjectStore`` (registered as the ``simstore`` protocol on import) and ``load``
(copy a local store's files into it). What it models of S3: a GET, PUT, DELETE or HEAD is one
request; a listing is one request per page of 1,000 keys, one page after another (S3's
continuation tokens); a HEAD of a missing key that may be a folder costs a LIST too (s3fs's
``info``). Requests run concurrently as the client sends them (fsspec's batches), at most
``connections`` at a time (the client's connection pool: what the store gives its S3 client). Its objects
live in the class, shared by every instance, as a bucket is shared by every client. Nothing
here models throttling or failures (``tests/support/slowdown.py`` and ``outage.py`` do, in
front of moto).

Used by ``benchmarks/store_metadata.py --sim-latency-ms``: the store's own metadata code at
62,500 shards against an object store's latency, which moto on loopback does not have.
"""

from __future__ import annotations

import asyncio
import collections
import os
from pathlib import Path
from typing import Any, ClassVar

import fsspec
from fsspec.asyn import AsyncFileSystem

from classgrad.store.core.location import S3_CONNECTIONS

PAGE = 1000  # keys per listing page, as S3's list_objects_v2


class SimulatedObjectStore(AsyncFileSystem):
    protocol = "simstore"
    objects: ClassVar[dict[str, bytes]] = {}
    requests: ClassVar[collections.Counter] = collections.Counter()
    latency_s: ClassVar[float] = 0.02
    connections: ClassVar[int] = S3_CONNECTIONS  # the client's pool: requests in flight at once
    _pools: ClassVar[dict[int, asyncio.Semaphore]] = {}  # one per event loop

    async def _request(self, kind: str, count: int = 1) -> None:
        type(self).requests[kind] += count
        loop = id(asyncio.get_running_loop())
        pool = self._pools.setdefault(loop, asyncio.Semaphore(self.connections))
        async with pool:
            await asyncio.sleep(self.latency_s)

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        await self._request("GET")
        path = self._strip_protocol(path)
        try:
            data = self.objects[path]
        except KeyError:
            raise FileNotFoundError(path) from None
        return data[start:end] if start is not None or end is not None else data

    async def _pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        await self._request("PUT")
        self.objects[self._strip_protocol(path)] = bytes(value)

    async def _rm_file(self, path: str, **kwargs: Any) -> None:
        await self._request("DELETE")
        self.objects.pop(self._strip_protocol(path), None)

    async def _rm(self, path: Any, recursive: bool = False, **kwargs: Any) -> None:
        for p in [path] if isinstance(path, str) else path:
            await self._rm_file(p)

    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path).rstrip("/")
        await self._request("HEAD")
        if path in self.objects:
            return {"name": path, "size": len(self.objects[path]), "type": "file"}
        await self._request("LIST")
        prefix = path + "/"
        if any(k.startswith(prefix) for k in self.objects):
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    async def _pages(self, entries: int) -> None:
        """A listing of ``entries`` keys or folders, paid as S3 pays: a request per page, one
        after another (each page's token comes with the one before)."""
        for _ in range(max(1, -(-entries // PAGE))):
            await self._request("LIST")

    async def _keys(self, prefix: str) -> list[str]:
        keys = sorted(k for k in self.objects if k.startswith(prefix))
        await self._pages(len(keys))
        return keys

    async def _ls(self, path: str, detail: bool = True, **kwargs: Any) -> list:
        path = self._strip_protocol(path).rstrip("/")
        prefix = path + "/" if path else ""
        entries: dict[str, dict[str, Any]] = {}
        for key in sorted(k for k in self.objects if k.startswith(prefix)):
            head, sep, _ = key[len(prefix) :].partition("/")
            name = prefix + head
            entries[name] = (
                {"name": name, "size": 0, "type": "directory"}
                if sep
                else {"name": name, "size": len(self.objects[key]), "type": "file"}
            )
        await self._pages(len(entries))  # a listing with a delimiter: its folders count once each
        if not entries and path not in self.objects:
            raise FileNotFoundError(path)
        return list(entries.values()) if detail else sorted(entries)

    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        path = self._strip_protocol(path).rstrip("/")
        detail = kwargs.pop("detail", False)
        found = {k: {"name": k, "size": len(self.objects[k]), "type": "file"} for k in await self._keys(path + "/")}
        return found if detail else sorted(found)

    async def _exists(self, path: str, **kwargs: Any) -> bool:
        try:
            await self._info(path)
            return True
        except FileNotFoundError:
            return False

    async def _mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        pass

    async def _makedirs(self, path: str, exist_ok: bool = False) -> None:
        pass


fsspec.register_implementation("simstore", SimulatedObjectStore, clobber=True)


def load(local: str | Path, url: str) -> int:
    """Copy every file of the local folder ``local`` to ``url`` (``simstore://bucket/path``),
    without paying latency; returns how many objects."""
    root = Path(local)
    base = url.removeprefix("simstore://").rstrip("/")
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder) / name
            SimulatedObjectStore.objects[f"{base}/{path.relative_to(root).as_posix()}"] = path.read_bytes()
    return len(SimulatedObjectStore.objects)
