"""Format 4: what every actor reads (the group's zarr.json) grows neither with the classes' names
nor with the run history. The names live in the ``class_name`` coordinate array, checked against
the digest the attributes record; each run's record is an object of its own (``runs/``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr

from classgrad.errors import StoreError
from classgrad.service.analysis.verify import verify_store
from classgrad.store import StoreSpec, create_store, open_store
from classgrad.store.store_keys import list_keys


def names_store(path, num_classes: int):
    spec = StoreSpec(
        num_classes=num_classes,
        dim=8,
        shard_rows=64,
        row_chunk=16,
        class_names=tuple(f"a rather long class name number {i}" for i in range(num_classes)),
        fingerprint="fp",
    )
    return create_store(str(path), spec)


def test_the_group_metadata_does_not_grow_with_the_class_names(tmp_path):
    small = names_store(tmp_path / "small", 64)
    large = names_store(tmp_path / "large", 20_000)  # 0.7 MB of names
    sizes = {p: (tmp_path / p / "zarr.json").stat().st_size for p in ("small", "large")}
    # The same metadata but for a few digits (counts, shard numbers): no name in it.
    assert sizes["large"] - sizes["small"] < 200, sizes
    assert "class name number" not in (tmp_path / "large" / "zarr.json").read_text()
    assert large.class_names[19_999] == "a rather long class name number 19999"
    again = open_store(str(tmp_path / "large"))
    assert again.spec.class_names == tuple(large.class_names) and small.format_version == 4
    assert again.attrs["class_names"]["count"] == 20_000  # what the attributes say of them


def test_class_names_changed_in_their_array_are_refused_and_verify_reports_them(tmp_path):
    names_store(tmp_path / "s", 64)
    group = zarr.open_group(str(tmp_path / "s"), mode="r+")
    names = group["class_name"][...]
    names[3] = "another class"
    group["class_name"][...] = names
    with pytest.raises(StoreError, match=r"its class names \(class_name\) are not the ones it was created with"):
        _ = open_store(str(tmp_path / "s")).class_names
    report = verify_store(str(tmp_path / "s"))
    assert report.code != 0
    assert any("coordinate 'class_name' differs" in p for p in report.problems["metadata"])


def test_each_run_is_an_object_of_its_own_and_the_group_metadata_stays_as_it_is(tmp_path):
    store = names_store(tmp_path / "s", 64)
    before = (tmp_path / "s" / "zarr.json").read_bytes()
    for i in range(3):
        store.append_run({"run_id": f"run-{i}", "peak_rss_per_actor": {str(a): a for a in range(1000)}})
    store.append_run({"run_id": "run-2", "peak_rss_per_actor": {str(a): a for a in range(1000)}})  # a retry
    assert (tmp_path / "s" / "zarr.json").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "s" / "runs").iterdir()) == ["000000.json", "000001.json", "000002.json"]
    assert [r["run_id"] for r in open_store(str(tmp_path / "s")).runs] == ["run-0", "run-1", "run-2"]
    assert json.loads((tmp_path / "s" / "runs" / "000001.json").read_text())["run_id"] == "run-1"
    # The run records are the store's own keys: deleted with it, never taken for foreign data.
    keys = list_keys(store._loc)
    assert not keys.others and "runs/000002.json" in keys.store
    report = verify_store(str(tmp_path / "s"))  # no rows yet: incomplete, nothing else
    assert report.problems["metadata"] == [] and report.problems["corrupt"] == []
    np.testing.assert_array_equal(open_store(str(tmp_path / "s")).shard_done, [False])


@pytest.mark.parametrize("edit", ["fill_value", "shape"])
def test_hand_edited_array_metadata_is_refused_on_open(tmp_path, edit):
    """Before: a ``fill_value`` of 0 read a deleted chunk as zero rows; a ``grads`` shape shrunk
    by 8 columns returned the narrower rows and ``run`` resumed it (issue 60, item 8)."""
    from classgrad.service.analysis.verify import METADATA
    from tests.support.stores import synthetic_store

    synthetic_store(tmp_path / "s", num_classes=64)
    meta_path = tmp_path / "s" / "grads" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    if edit == "fill_value":
        meta["fill_value"] = 0.0
        (tmp_path / "s" / "grads" / "c" / "1" / "0").unlink()
    else:
        meta["shape"][1] -= 8
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(StoreError, match=r"array 'grads' is \[64, (96|88)\] float32 .*; the store's metadata makes it"):
        open_store(str(tmp_path / "s"), mode="r+")
    assert verify_store(str(tmp_path / "s")).code & METADATA
