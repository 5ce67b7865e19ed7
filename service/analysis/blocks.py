"""What the analyses share: reading a store in blocks, completion, and small helpers.

Holds ``BlockPlan`` and ``plan_blocks`` (how many rows and columns one read may hold, given a
memory budget), ``spans`` (a range cut into blocks or bands), ``iter_tiles`` (true float32
tiles in row and column order), ``done_ranges``, ``completion`` (shards and rows done, missing
ranges), ``cosine_from_gram``, ``validated`` (options -> typed config, errors as one
``ConfigError`` line) and small formatting helpers. Nothing here imports torch, Ray or
matplotlib.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError

from classgrad.config import section_at
from classgrad.errors import ConfigError

ModelT = TypeVar("ModelT", bound=BaseModel)

# Default memory budget for one block of rows read at once (rows x columns x 4 bytes).
DEFAULT_BLOCK_MB = 64.0
MIB = 1 << 20


@dataclass(frozen=True)
class BlockPlan:
    """Rows and columns of one read: ``block_rows`` rows x ``band_cols`` columns."""

    block_rows: int
    band_cols: int

    def row_blocks(self, start: int, stop: int) -> list[tuple[int, int]]:
        return spans(start, stop, self.block_rows)

    def bands(self, dim: int) -> list[tuple[int, int]]:
        return spans(0, dim, self.band_cols)


def _round_down(value: int, unit: int) -> int:
    return max(unit, value - value % unit)


def plan_blocks(
    store,
    *,
    block_rows: int | None = None,
    band_cols: int | None = None,
    block_mb: float = DEFAULT_BLOCK_MB,
    max_rows: int | None = None,
    option: str = "--block-rows",
) -> BlockPlan:
    """Choose the read unit for ``store``.

    Given ``block_rows`` must be a multiple of the store's ``row_chunk`` (reads then cover whole
    chunks, and results written per row block cover whole chunks too); by default it is the
    largest multiple of ``row_chunk`` whose full-width block fits in ``block_mb`` MiB, capped
    at ``max_rows`` (rounded down to whole chunks). Columns are read in bands of ``band_cols``
    (default: all of them, or, when even ``block_rows`` full rows exceed the budget, the most
    whole column chunks that fit), so a read never holds more than about ``block_mb`` MiB,
    whatever the number of parameters.
    """
    rc, cc, C, D = store.row_chunk, store.col_chunk, store.num_classes, store.dim
    budget = int(block_mb * MIB)
    if block_mb <= 0:
        raise ConfigError(f"block size budget must be positive, got {block_mb}")
    if block_rows is not None:
        if block_rows < 1 or block_rows % rc:
            raise ConfigError(f"{option} must be a positive multiple of the store's row_chunk ({rc}), got {block_rows}")
        rows = block_rows
    else:
        rows = _round_down(budget // (4 * D) if D else C, rc)
        if max_rows is not None:
            rows = min(rows, _round_down(max_rows, rc))
    rows = min(rows, -(-C // rc) * rc)  # no point in more rows than the store has
    if band_cols is not None:
        if band_cols < 1:
            raise ConfigError(f"--band-cols must be positive, got {band_cols}")
        cols = min(band_cols, D)
    elif rows * D * 4 <= budget:
        cols = D
    else:
        cols = min(D, _round_down(budget // (4 * rows), cc))
    return BlockPlan(block_rows=rows, band_cols=max(1, cols))


def done_ranges(store, missing: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """Merged [start, stop) row ranges of shards marked done; ``missing`` is
    ``store.missing_ranges()`` when the caller already has it (no second read)."""
    out: list[tuple[int, int]] = []
    prev = 0
    for a, b in store.missing_ranges() if missing is None else missing:
        if a > prev:
            out.append((prev, a))
        prev = b
    if prev < store.num_classes:
        out.append((prev, store.num_classes))
    return out


def completion(store) -> dict:
    """How far a store's job has got, from one read of ``shard_done``: shards_done,
    shards_total, rows_done, complete and missing_ranges (a list of [start, stop) lists)."""
    done = store.shard_done
    missing = store.missing_ranges(done)
    return {
        "shards_done": int(done.sum()),
        "shards_total": int(done.size),
        "rows_done": int(store.num_classes - sum(b - a for a, b in missing)),
        "complete": not missing,
        "missing_ranges": [list(r) for r in missing],
    }


def iter_tiles(
    store,
    plan: BlockPlan,
    ranges: list[tuple[int, int]] | None = None,
) -> Iterator[tuple[int, int, int, int, np.ndarray]]:
    """Yield (r0, r1, c0, c1, true float32 values) over ``ranges`` of rows (default: all),
    row block by row block, each block band by band; at most one tile is alive at a time when
    the caller drops it before asking for the next."""
    for start, stop in ranges if ranges is not None else [(0, store.num_classes)]:
        for r0, r1 in plan.row_blocks(start, stop):
            for c0, c1 in plan.bands(store.dim):
                yield r0, r1, c0, c1, store.block(r0, r1, (c0, c1))


def cosine_from_gram(gram: np.ndarray) -> np.ndarray:
    """Cosine similarity from a square Gram matrix; rows of norm 0 get 0 everywhere."""
    norms = np.sqrt(np.clip(np.diag(gram).astype(np.float64), 0, None))
    inv = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    return (gram * (inv[:, None] * inv[None, :])).astype(np.float32)


def finite_summary(values: np.ndarray) -> dict:
    """min / median / max / mean of the finite values (None when there are none)."""
    v = values[np.isfinite(values)]
    if v.size == 0:
        return {"n": 0, "min": None, "median": None, "max": None, "mean": None}
    return {
        "n": int(v.size),
        "min": float(v.min()),
        "median": float(np.median(v)),
        "max": float(v.max()),
        "mean": float(v.mean()),
    }


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def spans(start: int, stop: int, step: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into ``(a, b)`` pieces of ``step`` (the last one shorter)."""
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]


def validated(model: type[ModelT], what: str, *, flags: bool = True, **values: Any) -> ModelT:
    """``model(**values)``, a validation error turned into one ``ConfigError`` line naming the
    option as a field and, with ``flags`` (a command's options), as its command-line flag; an
    unknown key (which no flag gives) lists the keys its section takes instead."""
    try:
        return model(**values)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        err = errors[0]
        loc = tuple(str(p) for p in err.get("loc", ()))
        field = ".".join(loc) or "options"
        unknown = err["type"] == "extra_forbidden"
        flag = f" (--{field.replace('_', '-')})" if flags and not unknown else ""
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        if unknown:
            section = section_at(loc[:-1], root=model)
            msg = f"unknown key (choices: {', '.join(section.model_fields)})" if section else msg
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        got = f", got {err['input']!r}" if "input" in err and not unknown else ""
        raise ConfigError(f"{what} option {field}{flag}: {msg}{got}{more}") from None


__all__ = [
    "BlockPlan",
    "DEFAULT_BLOCK_MB",
    "MIB",
    "ceil_div",
    "completion",
    "cosine_from_gram",
    "done_ranges",
    "finite_summary",
    "iter_tiles",
    "plan_blocks",
    "spans",
    "validated",
]
