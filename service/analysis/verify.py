"""Is a store sound? ``classgrad verify``: what it checks and the exit code that says what failed.

Holds the exit-code bit flags, ``VerifyReport`` and ``verify_store`` (with ``repair``: unmark the
damaged shards so that the next run recomputes them, and rewrite a format-3 store's consolidated
metadata when missing or stale).

Exit codes (bit flags, OR-ed together; 0 means every check passed)::

    0   all good
    4   INCOMPLETE  shards not marked done, or chunks missing from shards marked done
                    (or from a finished similarity)
    8   CORRUPT     a chunk fails its crc32c checksum, cannot be decoded, or cannot be read, or
                    (format 2) differs from its shard record's size or digest (a valid chunk
                    copied over another); a saved TRAK preconditioner that cannot be read or
                    fails its checksum
    16  NONFINITE   NaN or Inf stored in the rows (or loss) of a done shard, or in a finished
                    similarity
    32  METADATA    inconsistent metadata: format/state, sizes, dtype, the parameter layout
                    (offsets contiguous from 0, sizes matching shapes, summing to dim), class
                    ids/names (one per row), a missing fingerprint, array shapes/chunks, a
                    metadata digest that does not match (format 2),
                    shard_done values other than 0/1, row_scale not positive and finite (or
                    count negative) in a done row, top-k indices out of range, a similarity
                    computed from other rows

1 and 2 keep the meaning they have for every ``classgrad`` command (an internal error; a usage
error or a location that holds no classgrad store at all), so no flag uses those bits.
An unfinished similarity (a run that did not complete) is reported as a note, not a failure:
readers refuse it, and rerunning ``classgrad similarity`` replaces it. So is a preconditioner
that is unfinished or computed from other rows: ``classgrad score`` refuses or replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from classgrad.errors import StoreError
from classgrad.store import check_metadata, fmt_ranges, open_store
from classgrad.store.training_log.log_store import is_log
from classgrad.workers.projection import neighbour_caveat, structure_label

INCOMPLETE = 4
CORRUPT = 8
NONFINITE = 16
METADATA = 32
FLAG_NAMES = {INCOMPLETE: "incomplete", CORRUPT: "corrupt", NONFINITE: "nonfinite", METADATA: "metadata"}
_KIND_FLAGS = {
    "missing": INCOMPLETE,
    "corrupt": CORRUPT,
    "unreadable": CORRUPT,
    "nonfinite": NONFINITE,
    "bad_value": METADATA,
}
# Problems listed per check in the text output (all of them are in the JSON).
_SHOWN = 10


@dataclass
class VerifyReport:
    """Result of ``verify_store``: the OR of the failed flags and the problems per check."""

    store: str
    rows: str = ""  # what the rows are (``structures.structure_label``)
    problems: dict[str, list[str]] = field(default_factory=lambda: {name: [] for name in FLAG_NAMES.values()})
    notes: list[str] = field(default_factory=list)
    repaired: list[int] = field(default_factory=list)  # shards unmarked by ``--repair``

    def add(self, flag: int, line: str) -> None:
        self.problems[FLAG_NAMES[flag]].append(line)

    @property
    def code(self) -> int:
        return sum(flag for flag, name in FLAG_NAMES.items() if self.problems[name])

    def to_dict(self) -> dict:
        return {
            "store": self.store,
            "rows": self.rows,
            "exit_code": self.code,
            "failed": [FLAG_NAMES[f] for f in FLAG_NAMES if self.code & f],
            "problems": self.problems,
            "notes": self.notes,
            "repaired_shards": self.repaired,
        }

    def format(self) -> str:
        titles = {
            "incomplete": "completeness",
            "corrupt": "chunk checksums",
            "nonfinite": "NaN/Inf scan",
            "metadata": "metadata",
        }
        lines = [f"store       {self.store}"] + ([f"rows        {self.rows}"] if self.rows else [])
        for flag, name in FLAG_NAMES.items():
            found = self.problems[name]
            status = (
                "ok" if not found else f"FAILED ({len(found)} problem{'s' if len(found) != 1 else ''}, exit bit {flag})"
            )
            lines.append(f"{titles[name]:<16}{status}")
            lines += [f"  - {p}" for p in found[:_SHOWN]]
            if len(found) > _SHOWN:
                lines.append(f"  ... and {len(found) - _SHOWN} more (--json lists all)")
        lines += [f"note: {n}" for n in self.notes]
        lines.append(f"result      {'OK' if not self.code else 'FAILED'} (exit code {self.code})")
        return "\n".join(lines)


def verify_store(url: str, *, storage_options: dict | None = None, repair: bool = False) -> VerifyReport:
    """Run every check on the store at ``url``. Raises ``StoreError`` only when there is no
    classgrad store there at all; everything else is reported. With ``repair``, the done shards
    whose chunks are damaged are unmarked (under the store's lease) so that the next run
    recomputes them; the report still says what was found, and a note says what was unmarked."""

    report = VerifyReport(url)
    if is_log(url, storage_options=storage_options):
        open_store(url, storage_options=storage_options)  # refused in one line naming the log's reader
    for line in check_metadata(url, storage_options=storage_options):
        report.add(METADATA, line)
    try:
        store = open_store(url, storage_options=storage_options)
    except StoreError as exc:
        if not report.problems["metadata"]:
            raise
        report.notes.append(f"the store cannot be opened, so its data was not checked: {exc}")
        return report

    record = store.attrs.get("projection")
    report.rows = structure_label(record)
    caveat = neighbour_caveat(record)
    if caveat:
        report.notes.append(caveat)
    done = store.shard_done
    missing = store.missing_ranges(done)
    if missing:
        report.add(
            INCOMPLETE, f"{int((~done).sum())} of {store.num_shards} shards not marked done: rows {fmt_ranges(missing)}"
        )
    damaged: set[int] = set()
    for problem in store.scan_chunks(progress=None):  # a bar where someone sees it
        report.add(_KIND_FLAGS[problem.kind], problem.message)
        # A shard not marked done is already recomputed by the next run; a corrupt mark is rewritten.
        damaged.update(s for s in problem.shards if done[s] or problem.array == "shard_done")
    if repair:
        _repair(url, storage_options, sorted(damaged), report)
    for line in store.similarity_arrays.record_problems():  # a copied or changed result chunk
        report.add(CORRUPT, line)
    info = store.similarity_info()
    if info is not None and info.get("state") != "ready":
        report.notes.append(
            f"the similarity matrix is unfinished (run {info.get('run_id')!r}); "
            f"rerun `classgrad similarity` to replace it"
        )
    found = store.preconditioner.problem()
    if found is not None:
        kind, line = found
        if kind == "damaged":
            report.add(CORRUPT, line)
        else:
            report.notes.append(line)
    return report


def _repair(url: str, storage_options: dict | None, shards: list[int], report: VerifyReport) -> None:
    """Unmark ``shards`` and rewrite the consolidated metadata of a format-3 store when missing
    or stale, under the store's lease (a running job would race with it)."""
    import os
    import socket

    store = open_store(url, storage_options=storage_options, mode="r+")
    stale = store.consolidation_problems()  # format 3: what xarray.open_zarr reads
    if not shards and not stale:
        report.notes.append("repair: no damaged shard to unmark")
        return
    run_id = f"verify-repair-{os.getpid()}"
    with store.lease.hold(run_id, info={"host": socket.gethostname(), "pid": os.getpid(), "command": "verify"}):
        for shard in shards:
            store.clear_shard_done(shard)
        if stale:
            store.consolidate()
    if stale:
        report.notes.append("repair: rewrote the consolidated metadata")
    if shards:
        report.repaired = shards
        report.notes.append(
            f"repair: unmarked {len(shards)} damaged shard(s) {shards}; rerun `classgrad run` to recompute them"
        )
    else:
        report.notes.append("repair: no damaged shard to unmark")
