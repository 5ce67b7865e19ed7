"""The output of ``classgrad score --out``: a Zarr v3 group of per-query top-k classes and, when
asked, every query x class score, written block by block and resumable after a kill.

Holds ``ScoreOutput`` (``create_or_resume``, ``block_done``, ``query_rows``, ``write_topk``,
``write_scores``, ``mark_done``, ``finish``, ``read_topk``) and the key names.

Layout (dimension names in brackets; xarray-readable, ``xr.open_zarr(url)``):

- ``topk_class_id`` int64 [query, rank], ``topk_row`` int64 [query, rank] (the class's row in the
  stores), ``topk_score`` float32 [query, rank]: each query's best classes, best first, equal
  scores by lower row; chunks of one query block.
- ``scores`` float32 [query, class_id], only when every score was asked for (``full``): chunks of
  one query block x one class block, each written whole, once, by the task that owns the block.
- ``query_rows`` float32 [checkpoint, query, column]: the query rows scored (one set per store),
  written once at creation, so that a resumed run scores exactly the same rows.
- ``block_done`` uint8 [block]: 1 once a query block's results are written (the resume mark).
- ``score_records/<block>.json``: the xxh3-128 digest of each chunk the block wrote (bound to the
  array, the request and the chunk's place), written before its mark; ``read_topk`` checks them,
  and the query rows are checked against ``query_rows_digest`` when a resumed run reads them.
- coordinates ``query`` (0..Q-1), ``group`` (each row's group id as text, for rows of groups),
  ``rank``, ``class_id`` and ``class_name`` (when the stores know names), ``checkpoint``.

Group attributes ``classgrad_scores``: ``request`` (what was asked: stores and their rows
digests, method, damping, weights, top-k, the query set's digest) and its ``request_digest``,
``state`` (``computing`` / ``ready``), ``block_rows``, ``class_block``, timings. A rerun of the
same request resumes (blocks marked done are skipped); another request is refused unless
``overwrite``, which replaces only a location that holds a classgrad score output (or nothing).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Literal

import numpy as np
import zarr
from zarr.codecs import BytesCodec

from classgrad.errors import ClassgradError, CorruptChunkError, StoreError, StoreMismatchError, first_line
from classgrad.store.core.coords import consolidate
from classgrad.store.core.format import codecs
from classgrad.store.core.location import Location
from classgrad.store.integrity.shard_records import values_digest

ATTR = "classgrad_scores"
RECORDS_DIR = "score_records"  # <block>.json: the digest of each chunk of a done query block
TOPK_CLASS, TOPK_ROW, TOPK_SCORE = "topk_class_id", "topk_row", "topk_score"
SCORES, QUERY_ROWS, BLOCK_DONE = "scores", "query_rows", "block_done"


def _digest(name: str, request: str, chunk: str, values: np.ndarray) -> str:
    """A chunk's digest, bound to the array, the output's request and the chunk's place."""
    return values_digest(f"{name}\0{request}\0{chunk}", values)


def request_digest(request: dict) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True, default=str).encode()).hexdigest()


def _attrs(group: zarr.Group) -> dict:
    """The group's ``classgrad_scores`` attributes (empty when it has none)."""
    raw = group.attrs.get(ATTR)
    return dict(raw) if isinstance(raw, dict) else {}


def _fail(url: str, what: str, exc: Exception) -> StoreError:
    return StoreError(f"cannot {what} {url}: {first_line(exc, with_type=True)}")


class ScoreOutput:
    """An open score output (create it with ``create_or_resume``)."""

    def __init__(self, loc: Location, group: zarr.Group) -> None:
        self._loc = loc
        self._group = group
        self.info: dict = _attrs(group)
        # Outputs made before records (no "records" in their attributes) are read unchecked.
        self._recorded = bool(self.info.get("records"))
        self._pending: dict[str, dict[str, str]] = {}  # this block's chunk digests, until mark_done

    @property
    def url(self) -> str:
        return self._loc.url

    @property
    def local_path(self) -> str | None:
        """The absolute path of a local output (what Ray tasks, in other working directories, open)."""
        return self._loc.path if self._loc.local else None

    @classmethod
    def open(cls, url: str, storage_options: dict | None = None, mode: Literal["r", "r+"] = "r") -> ScoreOutput:
        loc = Location(url, storage_options)
        try:
            group = zarr.open_group(
                loc.zarr_store(read_only=mode == "r"), mode=mode, zarr_format=3, use_consolidated=False
            )
        except FileNotFoundError:
            raise StoreError(f"no score output at {url}") from None
        except Exception as exc:
            raise _fail(url, "open the score output", exc) from None
        if not isinstance(group.attrs.get(ATTR), dict):
            raise StoreError(f"{url} is not a classgrad score output")
        return cls(loc, group)

    @classmethod
    def check_target(
        cls, url: str, request: dict, *, storage_options: dict | None = None, overwrite: bool = False
    ) -> bool:
        """Whether ``url`` holds an output of this very request (a resume); refuses (one line) a
        location holding something else, unless ``overwrite`` and it is a score output. Writes nothing."""
        loc = Location(url, storage_options)
        if loc.is_empty():
            return False
        try:
            group = zarr.open_group(loc.zarr_store(read_only=True), mode="r", zarr_format=3, use_consolidated=False)
            info = group.attrs.get(ATTR)
        except Exception:  # noqa: BLE001 - not a Zarr group: refused below
            info = None
        if not isinstance(info, dict):
            raise StoreError(f"--out {url}: the location holds something else than a classgrad score output")
        if info.get("request_digest") == request_digest(request):
            return True
        if not overwrite:
            raise StoreMismatchError(
                f"--out {url} holds the scores of another request (stores, method, damping, weights, top-k "
                "or queries differ); give another --out, or --overwrite"
            )
        return False

    @classmethod
    def create_or_resume(
        cls,
        url: str,
        request: dict,
        *,
        query_rows: list[np.ndarray],
        class_ids: np.ndarray,
        class_names: list[str] | None,
        top_k: int,
        block_rows: int,
        class_block: int,
        full: bool,
        groups: list[str] | None = None,
        storage_options: dict | None = None,
        overwrite: bool = False,
    ) -> tuple[ScoreOutput, bool]:
        """(the output, whether it resumes one made by this same request)."""
        if cls.check_target(url, request, storage_options=storage_options, overwrite=overwrite):
            out = cls.open(url, storage_options, mode="r+")
            return out, True
        loc = Location(url, storage_options)
        Q, C = query_rows[0].shape[0], len(class_ids)
        nblocks = -(-Q // block_rows)
        try:
            group = zarr.open_group(loc.zarr_store(read_only=False), mode="w", zarr_format=3)
            info = {
                "request": json.loads(json.dumps(request, default=str)),
                "request_digest": request_digest(request),
                "state": "computing",
                "block_rows": block_rows,
                "class_block": class_block,
                "top_k": top_k,
                "full": full,
                "num_queries": Q,
                "num_classes": C,
                "started": time.time(),
                "records": True,  # each done block's chunk digests in score_records/, checked on read
            }
            coords = (["class_name"] if class_names is not None else []) + (["group"] if groups is not None else [])
            group.attrs.update({ATTR: info, "coordinates": " ".join(coords)})

            def make(name, shape, chunks, dtype, dims, fill, data=None, attrs=None):
                arr = group.create_array(
                    name,
                    shape=shape,
                    chunks=chunks,
                    dtype=dtype,
                    fill_value=fill,
                    serializer=BytesCodec(endian="little") if dtype is not str else "auto",
                    compressors=codecs("none"),
                    dimension_names=dims,
                    attributes=attrs or {},
                )
                if data is not None:
                    arr[...] = data
                return arr

            rows = np.stack([np.asarray(r, dtype=np.float32) for r in query_rows])
            make("query", (Q,), (max(Q, 1),), "int64", ("query",), -1, np.arange(Q))
            if groups is not None:  # one row per group: its id (as text) along the query dimension
                make("group", (Q,), (max(Q, 1),), str, ("query",), "", np.array(groups, dtype=object))
            make("rank", (top_k,), (max(top_k, 1),), "int64", ("rank",), -1, np.arange(top_k))
            make("class_id", (C,), (max(C, 1),), "int64", ("class_id",), -1, np.asarray(class_ids))
            make("checkpoint", (len(rows),), (len(rows),), "int64", ("checkpoint",), -1, np.arange(len(rows)))
            if class_names is not None:
                make("class_name", (C,), (max(C, 1),), str, ("class_id",), "", np.array(class_names, dtype=object))
            make(
                QUERY_ROWS,
                rows.shape,
                (1, min(Q, max(1, (16 << 20) // max(1, 4 * rows.shape[2]))), rows.shape[2]),
                "float32",
                ("checkpoint", "query", "column"),
                np.nan,
                rows,
                {"long_name": "the query rows scored, one set per store (checkpoint)"},
            )
            # Their digest, checked when a resumed run reads them back to score.
            info["query_rows_digest"] = _digest(QUERY_ROWS, info["request_digest"], "all", rows)
            group.attrs.update({ATTR: info})
            k_chunk = (block_rows, max(top_k, 1))
            desc = {"long_name": "best classes per query, best first"}
            make(TOPK_CLASS, (Q, top_k), k_chunk, "int64", ("query", "rank"), -1, attrs=desc)
            make(TOPK_ROW, (Q, top_k), k_chunk, "int64", ("query", "rank"), -1)
            make(TOPK_SCORE, (Q, top_k), k_chunk, "float32", ("query", "rank"), np.nan)
            if full:
                make(SCORES, (Q, C), (block_rows, class_block), "float32", ("query", "class_id"), np.nan)
            make(BLOCK_DONE, (nblocks,), (1,), "uint8", ("block",), 0)
        except ClassgradError:
            raise
        except Exception as exc:
            raise _fail(url, "create the score output", exc) from None
        out = cls(loc, group)
        out._consolidate()
        return out, False

    def _consolidate(self) -> None:
        try:
            consolidate(self._loc)
        except Exception as exc:
            raise _fail(self.url, "write the consolidated metadata of", exc) from None

    def block_done(self) -> np.ndarray:
        try:
            return np.asarray(self._array(BLOCK_DONE)[...], dtype=bool)
        except Exception as exc:
            raise _fail(self.url, "read the done marks of", exc) from None

    def query_rows(self, a: int, b: int) -> np.ndarray:
        """float32 [stores, b - a, width]: the query rows of queries [a, b) (all of them read once
        and checked against their digest in an output with records)."""
        if not self._recorded:
            return np.asarray(self._array(QUERY_ROWS)[:, a:b], dtype=np.float32)
        rows = np.asarray(self._array(QUERY_ROWS)[...], dtype=np.float32)
        if _digest(QUERY_ROWS, self.info["request_digest"], "all", rows) != self.info.get("query_rows_digest"):
            raise CorruptChunkError(
                f"score output {self.url}: its query rows do not match their digest (changed since it was "
                f"made); delete {self.url} and score again"
            )
        return rows[:, a:b]

    def _array(self, name: str) -> Any:
        return self._group[name]

    def _note(self, name: str, chunk: str, values: np.ndarray) -> None:
        if self._recorded:
            self._pending.setdefault(name, {})[chunk] = _digest(name, self.info["request_digest"], chunk, values)

    def write_topk(self, a: int, rows: np.ndarray, class_ids: np.ndarray, scores: np.ndarray) -> None:
        parts: list[tuple[str, np.ndarray]] = [
            (TOPK_ROW, np.asarray(rows, np.int64)),
            (TOPK_CLASS, np.asarray(class_ids, np.int64)),
            (TOPK_SCORE, scores.astype(np.float32)),
        ]
        try:
            b = a + len(rows)
            for name, values in parts:
                self._array(name)[a:b] = values
                self._note(name, str(a), values)
        except Exception as exc:
            raise _fail(self.url, f"write the top-k of queries [{a}, {a + len(rows)}) to", exc) from None

    def write_scores(self, a: int, j0: int, values: np.ndarray) -> None:
        values = values.astype(np.float32)
        try:
            self._array(SCORES)[a : a + values.shape[0], j0 : j0 + values.shape[1]] = values
        except Exception as exc:
            raise _fail(self.url, f"write the scores of queries from {a} to", exc) from None
        self._note(SCORES, f"{a},{j0}", values)

    def mark_done(self, block: int) -> None:
        """Query block ``block`` done: its record (the digest of each chunk written) first, then
        its mark."""
        try:
            if self._recorded:
                record = {"block": block, "digests": self._pending}
                self._loc.write_bytes(f"{RECORDS_DIR}/{block}.json", json.dumps(record).encode())
                self._pending = {}
            self._array(BLOCK_DONE)[block] = 1
        except Exception as exc:
            raise _fail(self.url, f"mark query block {block} done in", exc) from None

    def finish(self, summary: dict) -> None:
        info = _attrs(self._group)
        info.update(json.loads(json.dumps(summary, default=str)))
        info.update(state="ready", finished=time.time())
        try:
            self._group.attrs.update({ATTR: info})
        except Exception as exc:
            raise _fail(self.url, "finish", exc) from None
        self.info = info
        self._consolidate()

    def read_topk(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, class ids, scores) of every query's top-k; in an output with records, each
        done block's part checked against its record (a copied or changed chunk is refused)."""
        out = tuple(np.asarray(self._array(name)[...]) for name in (TOPK_ROW, TOPK_CLASS, TOPK_SCORE))
        if self._recorded:
            br = int(self.info["block_rows"])
            done = np.flatnonzero(self.block_done()).tolist()
            records = self._loc.read_many([f"{RECORDS_DIR}/{b}.json" for b in done])
            for b, data in zip(done, records, strict=True):
                try:
                    digests = json.loads(data)["digests"] if data is not None else {}
                except (ValueError, KeyError, TypeError):
                    digests = {}
                for name, values in zip((TOPK_ROW, TOPK_CLASS, TOPK_SCORE), out, strict=True):
                    got = _digest(name, self.info["request_digest"], str(b * br), values[b * br : (b + 1) * br])
                    if digests.get(name, {}).get(str(b * br)) != got:
                        raise CorruptChunkError(
                            f"score output {self.url}: {name} of query block {b} (queries {b * br}-"
                            f"{min((b + 1) * br, len(values)) - 1}) does not match its record (changed, copied or "
                            f"lost); delete {self.url} and score again"
                        )
        return out  # type: ignore[return-value]
