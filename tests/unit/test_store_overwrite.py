"""Overwriting a store: resuming is the safe default, a deletion cut short is finished, and only
what a classgrad store holds is ever deleted.

- ``overwrite=True`` on a store of the same config resumes it; ``recompute=True`` starts over.
- An overwrite killed (SIGKILL, in a real process) in the middle of its deletion leaves a marker
  next to the store: a rerun without overwrite is refused in one line that says how to finish,
  a rerun with overwrite finishes the deletion and creates the store, and files that are not
  the store's (inside its directory or beside it) are never deleted.
- Leftover chunks of a store with no group metadata (and no marker) are refused, then deleted
  with overwrite; mixed with anything else they are never touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import zarr

from classgrad.config import JobConfig
from classgrad.errors import StoreError, StoreMismatchError
from classgrad.store import StoreSpec, create_store, open_store
from tests.support.jobs import small_job


def spec(fingerprint: str = "fp-1", **kw) -> StoreSpec:
    return StoreSpec(num_classes=16, dim=6, shard_rows=4, row_chunk=2, col_chunk=3, fingerprint=fingerprint, **kw)


def fill(store, value: float = 1.0) -> None:
    for shard in range(store.num_shards):
        start, stop = store.shard_range(shard)
        store.write_rows(
            start, np.full((stop - start, 6), value), loss=np.ones(stop - start), count=np.ones(stop - start)
        )
        store.mark_shard_done(shard)


def files_under(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(r, f), path) for r, _, fs in os.walk(path) for f in fs)


def test_overwrite_resumes_a_store_of_the_same_config_and_recompute_starts_over(tmp_path):
    url = str(tmp_path / "s.zarr")
    fill(create_store(url, spec()), 3.0)
    again = create_store(url, spec(), overwrite=True)
    assert again.is_complete and np.array_equal(again.rows([0, 15]), np.full((2, 6), 3.0, dtype=np.float32))
    with pytest.raises(StoreMismatchError, match="overwrite"):  # recompute alone never replaces another config
        create_store(url, spec("fp-2"), recompute=True)
    fresh = create_store(url, spec(), recompute=True)
    assert fresh.fingerprint == "fp-1" and not fresh.shard_done.any()


def test_the_config_has_a_recompute_key_outside_the_fingerprint(tmp_path):
    base = small_job(str(tmp_path / "s.zarr"))
    plain = JobConfig.model_validate(base)
    forced = JobConfig.model_validate({**base, "store": {**base["store"], "recompute": True, "overwrite": True}})
    assert plain.store.recompute is False and forced.store.recompute is True
    assert plain.fingerprint() == forced.fingerprint()  # a forced recompute computes the same store


_KILLED_OVERWRITE = textwrap.dedent(
    """
    import os, signal, sys
    from classgrad.store import StoreSpec, create_store

    url, kill_at, real_unlink = sys.argv[1], int(sys.argv[2]), os.unlink

    def unlink(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        # Count the files deleted inside the store (shutil.rmtree passes names relative to dir_fd).
        if kwargs.get("dir_fd") is not None or str(path).startswith(url + "/"):
            unlink.count += 1
            if unlink.count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # the overwrite dies in the middle of its deletion
    unlink.count = 0
    os.remove = os.unlink = unlink
    spec = StoreSpec(num_classes=16, dim=6, shard_rows=4, row_chunk=2, col_chunk=3, fingerprint="fp-2")
    create_store(url, spec, overwrite=True)
    """
)


def test_an_overwrite_killed_mid_delete_is_finished_by_a_rerun_with_overwrite(tmp_path):
    url = str(tmp_path / "s.zarr")
    fill(create_store(url, spec()))
    (tmp_path / "s.zarr" / "notes.txt").write_text("mine")  # not the store's: never deleted
    (tmp_path / "s.zarr" / "grads" / "README").write_text("mine too")
    (tmp_path / "s.zarr.backup").write_text("beside it")
    total = len(files_under(url))
    killed = subprocess.run([sys.executable, "-c", _KILLED_OVERWRITE, url, "5"], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    left = files_under(url)
    assert 3 < len(left) < total and "zarr.json" not in left  # the group went first, then 4 more keys
    assert os.path.exists(f"{url}.classgrad-deleting")
    with pytest.raises(StoreError, match="no classgrad store"):
        open_store(url)

    with pytest.raises(StoreError) as info:
        create_store(url, spec())
    message = str(info.value)
    assert "was being deleted (overwrite" in message and "--set store.overwrite=true" in message
    assert "\n" not in message and files_under(url) == left

    new = create_store(url, spec("fp-3"), overwrite=True)
    assert new.fingerprint == "fp-3" and not new.shard_done.any()
    assert not os.path.exists(f"{url}.classgrad-deleting")
    assert (tmp_path / "s.zarr" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "s.zarr" / "grads" / "README").read_text() == "mine too"
    assert (tmp_path / "s.zarr.backup").read_text() == "beside it"
    fill(new, 2.0)
    assert open_store(url).verify_chunks() == []


def test_leftover_chunks_without_metadata_are_deleted_with_overwrite_only(tmp_path):
    url = str(tmp_path / "s.zarr")
    fill(create_store(url, spec()))
    for key in ("zarr.json", "grads/zarr.json", "loss/zarr.json"):
        os.remove(os.path.join(url, key))  # the metadata lost, the chunks left (as after a lost bucket)
    left = files_under(url)
    with pytest.raises(StoreError, match=r"holds chunks of a classgrad store but no store metadata.*overwrite=true"):
        create_store(url, spec())
    assert files_under(url) == left
    assert create_store(url, spec(), overwrite=True).fingerprint == "fp-1"
    assert not os.path.exists(os.path.join(url, "grads", "c"))  # the old chunks are gone

    # Leftovers mixed with anything else are not recognisably a store's: never touched.
    for key in ("zarr.json",):
        os.remove(os.path.join(url, key))
    (tmp_path / "s.zarr" / "data.csv").write_text("1,2")
    before = files_under(url)
    with pytest.raises(StoreError, match="not a classgrad store"):
        create_store(url, spec(), overwrite=True)
    assert files_under(url) == before


def test_an_overwrite_deletes_only_the_stores_keys(tmp_path):
    url = str(tmp_path / "s.zarr")
    fill(create_store(url, spec()))
    (tmp_path / "s.zarr" / "grads" / "c" / "notes").write_text("not a chunk key")
    (tmp_path / "s.zarr" / "lease.json").write_text("{}")  # where stores written before kept the lease
    create_store(url, spec("fp-2"), overwrite=True)
    assert files_under(url) == sorted(
        [
            "zarr.json",
            "grads/c/notes",
            "class_id/c/0",  # format 3's coordinate of class ids, written at creation (one chunk)
            *(
                f"{a}/zarr.json"
                for a in ("class_id", "count", "grads", "loss", "row_scale", "shard_done", "shard_records")
            ),
        ]
    )
    assert zarr.open_group(url, mode="r").attrs["classgrad"]["fingerprint"] == "fp-2"


def test_a_store_url_that_is_a_symbolic_link_is_refused_before_anything_is_deleted(tmp_path):
    """Before: a job whose store.url was a link to another job's store, with overwrite, deleted
    every key of that store, then failed with NotADirectoryError on every retry (issue 60, item 9)."""
    from classgrad.store import store_lease

    other = str(tmp_path / "other.zarr")
    fill(create_store(other, spec("fp-other")), 2.0)
    before = files_under(other)
    link = tmp_path / "link.zarr"
    link.symlink_to(other)
    for make in (
        lambda: create_store(str(link), spec("fp-mine"), overwrite=True),
        lambda: store_lease(str(link)),  # what the driver takes first
    ):
        with pytest.raises(StoreError, match=r"link.zarr is a symbolic link \(to .*other.zarr\): give the real path"):
            make()
    assert files_under(other) == before and open_store(other).is_complete  # untouched
    assert open_store(str(link)).is_complete  # reading through a link is harmless
