"""``classgrad verify``: each kind of damage, made by hand on a sound store, is caught and
named, with its exit-code bit: 4 incomplete (a shard not done, a chunk deleted from a done
shard), 8 corrupt (a flipped byte), 16 NaN/Inf (written straight into a chunk file with a
valid checksum, or through zarr, bypassing ``write_rows``' check), 32 metadata."""

from __future__ import annotations

import json
import os
import struct

import crc32c
import numpy as np
import pytest
import zarr

from classgrad.errors import StoreError
from classgrad.service.analysis.similarity import compute_similarity
from classgrad.service.analysis.verify import CORRUPT, INCOMPLETE, METADATA, NONFINITE, verify_store
from classgrad.service.commands.cli import main as cli_main
from classgrad.store import open_store
from tests.support.stores import synthetic_store

# synthetic_store: 200 classes x 96, chunks 16 x 40, shards of 64 rows (4 shards).
CHUNK = (16, 40)


@pytest.fixture
def sound(tmp_path):
    synthetic_store(tmp_path / "s", num_classes=200)
    return tmp_path / "s"


def verify(path, capsys) -> tuple[int, str]:
    code = cli_main(["verify", str(path)])
    return code, capsys.readouterr().out


def set_attr(path, key, value) -> None:
    group = zarr.open_group(str(path), mode="r+")
    meta = group.attrs["classgrad"]
    meta[key] = value
    group.update_attributes({"classgrad": meta})


def test_sound_store(sound, capsys):
    code, out = verify(sound, capsys)
    assert code == 0 and "result      OK (exit code 0)" in out
    assert verify_store(str(sound)).to_dict()["failed"] == []


def test_flipped_byte_is_a_corrupt_chunk(sound, capsys):
    chunk = sound / "grads" / "c" / "2" / "1"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x01
    chunk.write_bytes(bytes(data))
    code, out = verify(sound, capsys)
    assert code == CORRUPT
    assert "grads chunk (2, 1) (key grads/c/2/1, rows [32, 48)): crc32c checksum mismatch" in out


def test_missing_shard_and_deleted_chunk_are_incomplete(sound, capsys):
    from classgrad.store import open_store

    open_store(str(sound), mode="r+").clear_shard_done(1)
    code, out = verify(sound, capsys)
    assert code == INCOMPLETE and "1 of 4 shards not marked done: rows [64, 128)" in out
    os.remove(sound / "grads" / "c" / "9" / "0")  # rows [144, 160): shard 2, still done
    report = verify_store(str(sound))
    assert report.code == INCOMPLETE
    assert any(
        "grads chunk (9, 0)" in p and "missing although its rows are marked done" in p
        for p in report.problems["incomplete"]
    )


def test_nan_bits_written_into_a_chunk_file(sound, capsys):
    """A NaN row, written into the chunk file with a correct checksum: only the scan sees it."""
    chunk = sound / "grads" / "c" / "1" / "0"  # rows [16, 32), columns [0, 40)
    raw = chunk.read_bytes()
    values = np.frombuffer(raw[:-4], dtype="<f4").reshape(CHUNK).copy()
    values[4, :] = np.nan  # row 20
    body = values.tobytes()
    chunk.write_bytes(body + struct.pack("<I", crc32c.crc32c(body)))
    code, out = verify(sound, capsys)
    assert code == NONFINITE
    assert "grads chunk (1, 0) (key grads/c/1/0, rows [16, 32)): rows [20, 21): 40 NaN/Inf" in out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_nonfinite_written_through_zarr(tmp_path, dtype):
    """Through zarr, bypassing write_rows: for bfloat16 the NaN written (0x7FC0) is the very
    fill value of a missing chunk; the chunk object exists, so it is called a NaN, not a gap."""
    synthetic_store(tmp_path / "s", num_classes=100, dtype=dtype)
    grads = zarr.open_group(str(tmp_path / "s"), mode="r+")["grads"]
    bad = np.uint16(0x7FC0) if dtype == "bfloat16" else np.float16(np.inf)
    grads[70, 50] = bad
    report = verify_store(str(tmp_path / "s"))
    assert report.code == NONFINITE
    assert report.problems["nonfinite"] == [
        "grads chunk (4, 1) (key grads/c/4/1, rows [64, 80)): rows [70, 71): 1 NaN/Inf values"
    ]


def test_metadata_problems(sound, capsys):
    group = zarr.open_group(str(sound), mode="r+")
    group["row_scale"][5] = -1.0
    group["shard_done"][2] = 7
    set_attr(sound, "fingerprint", "")
    code, out = verify(sound, capsys)
    assert code == METADATA
    assert "fingerprint is '': missing" in out and "shard_done[2] = 7 (expected 0 or 1)" in out
    assert "row_scale chunk (0,) (key row_scale/c/0, rows [0, 16)): rows [5, 6): invalid" in out


def test_broken_layout_is_reported_even_though_the_store_cannot_open(sound, capsys):
    group = zarr.open_group(str(sound), mode="r+")
    meta = group.attrs["classgrad"]
    meta["layout"][1]["offset"] = 81
    meta["class_ids"] = list(range(199))
    group.update_attributes({"classgrad": meta})
    report = verify_store(str(sound))
    assert report.code == METADATA
    text = "\n".join(report.problems["metadata"])
    assert "layout entry 'layer.bias' starts at 81, expected 80" in text
    assert "class_ids has 199 entries, expected one per row (200)" in text
    assert "cannot be opened" in report.notes[0]


def test_a_truncated_array_metadata_file_is_named_in_one_line(sound, capsys):
    """Before: verify, inspect, score, similarity and run said ``internal error: JSONDecodeError``
    (exit 1) and open_store raised the raw error (issue 45, item 6)."""
    meta = sound / "grads" / "zarr.json"
    meta.write_bytes(meta.read_bytes()[:200])
    code, out = verify(sound, capsys)
    assert code == METADATA and "array 'grads': its metadata (grads/zarr.json) cannot be read" in out
    with pytest.raises(StoreError, match=r"the metadata of 'grads' \(grads/zarr.json\) cannot be read"):
        open_store(str(sound))
    for command in (["inspect", str(sound)], ["similarity", str(sound), "--local"]):
        assert cli_main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "grads/zarr.json" in err[0]
    (sound / "zarr.json").write_bytes((sound / "zarr.json").read_bytes()[:100])  # the group's own
    assert cli_main(["verify", str(sound)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "zarr.json cannot be read" in err[0]


@pytest.mark.parametrize("name", ["class_id", "param_id"])
def test_a_truncated_coordinate_metadata_file_is_a_metadata_problem(sound, capsys, name):
    """Before: ``internal error: JSONDecodeError`` (exit 1) where the metadata bit (32) belongs
    (issue 60, item 14)."""
    meta = sound / name / "zarr.json"
    meta.write_bytes(meta.read_bytes()[: len(meta.read_bytes()) // 2])
    code, out = verify(sound, capsys)
    assert code == METADATA and f"coordinate '{name}' cannot be opened ({name}/zarr.json)" in out


def test_flags_combine_and_json(sound, capsys):
    from classgrad.store import open_store

    open_store(str(sound), mode="r+").clear_shard_done(3)
    chunk = sound / "loss" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    assert cli_main(["verify", str(sound), "--json"]) == INCOMPLETE | CORRUPT == 12
    out = json.loads(capsys.readouterr().out)
    assert out["exit_code"] == 12 and out["failed"] == ["incomplete", "corrupt"]
    assert out["problems"]["corrupt"][0].startswith("loss chunk (0,) (key loss/c/0")


def test_similarity_arrays_are_checked(sound, capsys):
    from classgrad.store import open_store

    compute_similarity(str(sound), executor="local", top_k=3)
    assert verify(sound, capsys)[0] == 0
    chunk = sound / "similarity" / "c" / "1" / "0"
    data = bytearray(chunk.read_bytes())
    data[8] ^= 0x10
    chunk.write_bytes(bytes(data))
    code, out = verify(sound, capsys)
    assert code == CORRUPT and "similarity chunk (1, 0)" in out
    # An unfinished rerun is a note, not a failure: readers refuse it and a rerun replaces it.
    open_store(str(sound), mode="r+").similarity_arrays.begin(metric="dot", top_k=2, chunk_rows=16, run_id="died")
    code, out = verify(sound, capsys)
    assert code == 0 and "note: the similarity matrix is unfinished (run 'died')" in out


def test_not_a_store_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli_main(["verify", str(tmp_path / "empty")]) == 2
    assert "no classgrad store" in capsys.readouterr().err
