"""Store format 2 (issue 15, items 3, 6 and 7): per-shard records, the metadata digest, verify's
digest check and ``--repair``, a corrupt ``shard_done`` chunk read as "not done", the fsync order
before ``shard_done``, and format-1 stores still read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from classgrad.service.analysis.inspect import format_report, inspect_store
from classgrad.service.analysis.verify import CORRUPT, INCOMPLETE, METADATA, verify_store
from classgrad.store import FORMAT_VERSION, open_store
from tests.support.stores import synthetic_store

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stores"


def _store(tmp_path: Path, **kw):
    # 200 rows in 4 shards of 64 (the last short), chunks 16 x 40 of 96 columns: 3 column chunks.
    return synthetic_store(tmp_path / "s", num_classes=200, **kw)


def _flip(path: Path, offset: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_format_version_is_4_and_records_cover_every_chunk_of_a_done_shard(tmp_path):
    store, _ = _store(tmp_path)
    assert FORMAT_VERSION == 4 and store.format_version == 4
    record = store.shard_record(1)
    assert record is not None and record.rows == (64, 128)
    # rows 64-127 = row chunks 4-7: grads 4 x 3 column chunks, 4 chunks each of row_scale, loss, count
    assert len(record.chunks) == 4 * 3 + 3 * 4
    for key, (size, _) in record.chunks.items():
        assert (tmp_path / "s" / key).stat().st_size == size
    assert store.damaged_done_shards() == {}


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_resume_check_finds_a_lost_or_truncated_chunk_from_one_listing(tmp_path, damage):
    store, _ = _store(tmp_path)
    chunk = tmp_path / "s" / "grads" / "c" / "5" / "1"  # rows 80-95: shard 1
    if damage == "delete":
        chunk.unlink()
    else:
        chunk.write_bytes(chunk.read_bytes()[:-10])
    damaged = store.damaged_done_shards()
    assert list(damaged) == [1] and "grads/c/5/1" in damaged[1][0]
    done = store.unmark_damaged_shards()
    assert done.tolist() == [True, False, True, True]
    assert open_store(str(tmp_path / "s")).shard_done.tolist() == [True, False, True, True]


def test_a_valid_chunk_copied_over_another_fails_verify_naming_it(tmp_path):
    store, _ = _store(tmp_path)
    src, dst = tmp_path / "s" / "grads" / "c" / "0" / "0", tmp_path / "s" / "grads" / "c" / "9" / "0"
    shutil.copyfile(src, dst)  # same size, valid crc32c: only the record's digest can tell
    report = verify_store(str(tmp_path / "s"))
    assert report.code == CORRUPT
    assert any("grads/c/9/0" in p and "digest" in p for p in report.problems["corrupt"])
    assert store.damaged_done_shards() == {}  # sizes match: the resume check cannot see it, verify does


def test_verify_repair_unmarks_exactly_the_damaged_shards(tmp_path):
    _store(tmp_path)
    root = tmp_path / "s"
    _flip(root / "grads" / "c" / "2" / "0")  # shard 0
    shutil.copyfile(root / "loss" / "c" / "0", root / "loss" / "c" / "9")  # shard 2
    report = verify_store(str(root), repair=True)
    assert report.code == CORRUPT and report.repaired == [0, 2]
    assert open_store(str(root)).shard_done.tolist() == [False, True, False, True]
    after = verify_store(str(root), repair=True)
    # Nothing damaged is marked done any more (the flipped chunk is still reported until a rerun
    # rewrites it), so there is nothing left to unmark.
    assert after.code & INCOMPLETE and after.repaired == []


def test_corrupt_shard_done_chunk_reads_as_not_done(tmp_path, caplog):
    store, _ = _store(tmp_path)
    _flip(tmp_path / "s" / "shard_done" / "c" / "2", 0)  # its one byte: the crc32c fails
    reopened = open_store(str(tmp_path / "s"))
    with caplog.at_level("WARNING"):
        assert reopened.shard_done.tolist() == [True, True, False, True]
    assert "shard 2" in caplog.text
    inspect_store(reopened)  # inspect (and status, run) read the same flags: no failure
    assert reopened.missing_ranges() == [(128, 192)]
    report = verify_store(str(tmp_path / "s"), repair=True)
    assert report.code & CORRUPT and report.repaired == [2]
    assert open_store(str(tmp_path / "s")).shard_done.tolist() == [True, True, False, True]


def test_metadata_digest_catches_a_changed_class_id(tmp_path):
    _store(tmp_path, class_ids=tuple(range(1000, 1200)))
    root = tmp_path / "s"
    assert verify_store(str(root)).code == 0
    meta = json.loads((root / "zarr.json").read_text())
    ids = meta["attributes"]["classgrad"]["class_ids"]
    ids[3], ids[4] = ids[4], ids[3]  # still distinct integers: only the digest can tell
    (root / "zarr.json").write_text(json.dumps(meta))
    report = verify_store(str(root))
    assert report.code == METADATA and "metadata_digest does not match" in report.problems["metadata"][0]


def test_run_history_does_not_change_the_metadata_digest(tmp_path):
    store, _ = _store(tmp_path)
    store.append_run({"run_id": "x", "status": "complete"})
    assert verify_store(str(tmp_path / "s")).code == 0


def test_marking_done_syncs_chunks_dirs_and_record_before_writing_shard_done(tmp_path, monkeypatch):
    store, _ = _store(tmp_path, shards=[])  # created, nothing written
    root = os.path.realpath(tmp_path / "s")
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), root)))
        real_fsync(fd)

    def replace(src, dst) -> None:
        calls.append(("replace", os.path.relpath(os.path.realpath(dst), root)))
        real_replace(src, dst)

    a, b = store.shard_range(1)
    store.write_rows(a, np.ones((b - a, store.dim), np.float32), loss=np.ones(b - a), count=np.ones(b - a))
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store.mark_shard_done(1)
    done_at = calls.index(("replace", "shard_done/c/1"))
    before = {path for kind, path in calls[:done_at] if kind == "fsync"}
    chunks = set(store.shard_record(1).chunks)
    assert chunks <= before  # every chunk file of the shard
    assert {"grads/c/4", "grads/c", "grads", "loss/c", "."} <= before  # their directories, up to the root
    record_at = calls.index(("replace", "shard_records/1.json"))
    assert ("fsync", "shard_records/1.json") not in calls  # synced under its temporary name, then renamed:
    assert calls[record_at - 1][0] == "fsync" and calls[record_at + 1] == ("fsync", "shard_records")
    assert record_at < done_at
    assert calls[done_at - 1][0] == "fsync" and calls[done_at + 1] == ("fsync", "shard_done/c")  # mark synced


def test_not_durable_skips_the_fsyncs(tmp_path, monkeypatch):
    store, _ = _store(tmp_path, shards=[])
    store.durable = False
    count = []
    monkeypatch.setattr(os, "fsync", lambda fd: count.append(fd))
    a, b = store.shard_range(0)
    store.write_rows(a, np.ones((b - a, store.dim), np.float32), loss=np.ones(b - a), count=np.ones(b - a))
    store.mark_shard_done(0)
    assert count == [] and store.shard_done[0]


@pytest.mark.parametrize("codec", ["zstd"])
def test_zarr_path_records_read_back_objects(tmp_path, codec):
    store, _ = _store(tmp_path, codec=codec)
    assert store.damaged_done_shards() == {}
    assert verify_store(str(tmp_path / "s")).code == 0
    src, dst = tmp_path / "s" / "grads" / "c" / "0" / "0", tmp_path / "s" / "grads" / "c" / "1" / "0"
    shutil.copyfile(src, dst)
    assert verify_store(str(tmp_path / "s")).code == CORRUPT


def test_format_1_store_opens_reads_verifies_and_inspect_names_its_version(tmp_path):
    copy = tmp_path / "v1.zarr"
    shutil.copytree(FIXTURES / "v1_resume.zarr", copy)
    store = open_store(str(copy))
    assert store.format_version == 1 and store.is_complete
    assert np.isfinite(store.rows(np.arange(store.num_classes))).all()
    assert store.damaged_done_shards() == {}  # no records: trusted as before
    assert verify_store(str(copy)).code == 0
    info = inspect_store(store)
    assert info["format_version"] == 1 and "format      version 1" in format_report(info)
    # Marking a shard done again (a resume) keeps the format: no records appear in a format-1 store.
    writable = open_store(str(copy), mode="r+")
    zarr.open_array(str(copy / "shard_done"), mode="r+")[0] = 0
    writable.mark_shard_done(0)
    assert not (copy / "shard_records").exists() and verify_store(str(copy)).code == 0


def test_done_marks_are_read_raw_and_agree_with_zarr_whatever_each_mark_holds(tmp_path, monkeypatch):
    """The raw reader of the marks (``done_marks``: one plain read each, not zarr's pipeline per
    chunk) gives zarr's flags for a done, a missing, a zero and a corrupt mark, and never runs
    zarr's read of ``shard_done`` on a store laid out as classgrad writes it."""
    from classgrad.store.rows.done_marks import read_done_marks

    store, _ = _store(tmp_path)
    marks = tmp_path / "s" / "shard_done" / "c"
    (marks / "1").unlink()  # never marked: the fill value
    _flip(marks / "2", 0)  # corrupt
    zarr_flags = []
    for shard in range(4):
        try:
            zarr_flags.append(bool(zarr.open_array(str(tmp_path / "s" / "shard_done"), mode="r")[shard]))
        except Exception:  # noqa: BLE001 - zarr's checksum error: "not done", as the reader says
            zarr_flags.append(False)
    reopened = open_store(str(tmp_path / "s"))
    values, corrupt = read_done_marks(reopened._arrays, np.arange(4))
    assert (values != 0).tolist() == zarr_flags == [True, False, False, True] and corrupt == [2]
    calls = []
    original = zarr.Array.get_orthogonal_selection
    monkeypatch.setattr(
        zarr.Array, "get_orthogonal_selection", lambda self, *a, **k: calls.append(self.path) or original(self, *a, **k)
    )
    assert reopened.shard_done.tolist() == [True, False, False, True] and "shard_done" not in calls


def test_a_hand_edited_mark_layout_is_refused_and_never_read_raw(tmp_path):
    """A ``shard_done`` whose metadata is not the one classgrad writes (here a fill value of 1,
    which would read a deleted mark as done): the store refuses to open (issue 60, item 8); the
    raw reader, which never applies a fill value, reads the deleted mark as not done."""
    import zarr

    from classgrad.errors import StoreError
    from classgrad.store.core.location import Location
    from classgrad.store.rows.arrays import StoreArrays
    from classgrad.store.rows.done_marks import read_done_marks

    _store(tmp_path)
    meta_path = tmp_path / "s" / "shard_done" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["fill_value"] = 1
    meta_path.write_text(json.dumps(meta))
    (tmp_path / "s" / "shard_done" / "c" / "1").unlink()
    with pytest.raises(StoreError, match=r"array 'shard_done' is \[4\] uint8 in chunks \[1\], fill 1"):
        open_store(str(tmp_path / "s"))
    loc = Location(str(tmp_path / "s"), None)
    arrays = StoreArrays(loc, zarr.open_group(str(tmp_path / "s"), mode="r"), "r")
    found = read_done_marks(arrays, np.arange(4))
    assert found is None or found[0].tolist() == [1, 0, 1, 1]


def test_verify_reads_each_recorded_object_once(tmp_path, monkeypatch):
    """``classgrad verify`` checks the records against the bytes its scan read (the store leaves
    each whole read's digest, ``DigestCheckingStore.fetched``), so every recorded chunk object
    and every record is read once, not twice as before. The marks (5 bytes each, read raw) are
    read twice: once for the completeness line, once by the scan, which checks their values."""
    import collections

    from classgrad.store.core.location import Location
    from classgrad.store.integrity.shard_records import ShardRecord, record_key
    from classgrad.store.integrity.verified import DigestCheckingStore

    _store(tmp_path)
    root = tmp_path / "s"
    reads: collections.Counter = collections.Counter()
    get, read_many = DigestCheckingStore.get, Location.read_many

    async def counting_get(self, key, prototype, byte_range=None):
        reads[key] += 1
        return await get(self, key, prototype, byte_range)

    def counting_read_many(self, names):
        reads.update(names)
        return read_many(self, names)

    monkeypatch.setattr(DigestCheckingStore, "get", counting_get)
    monkeypatch.setattr(Location, "read_many", counting_read_many)
    assert verify_store(str(root)).code == 0
    recorded = set()
    for shard in range(4):
        record = ShardRecord.parse((root / record_key(shard)).read_bytes())
        recorded |= set(record.chunks)
        assert reads[record_key(shard)] == 1, record_key(shard)
        assert reads[f"shard_done/c/{shard}"] == 2
    assert recorded and {key: reads[key] for key in recorded} == dict.fromkeys(recorded, 1)


def test_a_record_that_covers_less_than_its_shard_vouches_for_nothing(tmp_path):
    """Issue 56, item 1: a valid chunk copied over another of the same shard, and that chunk's
    key dropped from the shard's record. Before: the reader returned 16 wrong rows and verify
    and ``verify --repair`` said OK. Now the read is refused in one line, a resume unmarks the
    shard, verify reports it and ``--repair`` unmarks it."""
    from classgrad.errors import CorruptChunkError
    from classgrad.store.integrity.shard_records import record_key

    _store(tmp_path)
    root = tmp_path / "s"
    shutil.copyfile(root / "grads" / "c" / "0" / "0", root / "grads" / "c" / "1" / "0")  # rows 16-31 <- 0-15
    path = root / record_key(0)
    record = json.loads(path.read_text())
    del record["chunks"]["grads/c/1/0"]
    path.write_text(json.dumps(record))

    with pytest.raises(CorruptChunkError, match=r"chunk grads/c/1/0 of shard 0 .* is not in its shard record"):
        open_store(str(root)).rows([17])
    problems = open_store(str(root)).damaged_done_shards()
    assert problems == {0: ["its record does not cover chunk grads/c/1/0"]}
    report = verify_store(str(root), repair=True)
    assert report.code & CORRUPT and report.repaired == [0]
    assert any("does not cover chunk grads/c/1/0" in line for line in report.problems["corrupt"]), report.problems
    assert open_store(str(root)).shard_done.tolist() == [False, True, True, True]


@pytest.mark.parametrize("name", ["count", "loss"])
def test_a_missing_count_or_loss_chunk_of_a_done_shard_is_refused(tmp_path, name):
    """Issue 60, item 7: before, ``count()`` returned -1 and ``loss()`` NaN for 16 classes of a
    done shard whose chunk was deleted, with no error; a record lists the chunk, so its loss
    is refused in one line by every reader."""
    from classgrad.errors import CorruptChunkError

    _store(tmp_path)
    root = tmp_path / "s"
    (root / name / "c" / "1").unlink()  # rows 16-31, in shard 0 (done)
    store = open_store(str(root))
    with pytest.raises(CorruptChunkError, match=rf"chunk {name}/c/1 of shard 0 .* is missing, though its shard record"):
        getattr(store, name)([20])
    assert getattr(store, name)([70]).shape == (1,)  # another shard still reads
