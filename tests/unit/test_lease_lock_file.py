"""The local lease's lock file (``STORE.classgrad-lease.lock``) goes with the lease (issue 29: one
was left beside every deleted store), and removing it never lets two holders in at once: a
waiter that locked the removed file locks the new one instead."""

from __future__ import annotations

import fcntl
import os
import threading
import time

from classgrad.store import store_lease
from classgrad.store.integrity.lease_files import LocalLeaseFile


def test_no_lock_file_is_left_once_the_lease_is_released(tmp_path):
    url = str(tmp_path / "s.zarr")
    with store_lease(url).hold("run-1", ttl_s=60, info={}):
        assert any(p.name.endswith(".lock") for p in tmp_path.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no lease, no lock: nothing beside the store


def test_a_waiter_on_a_removed_lock_file_locks_the_new_one(tmp_path):
    lease = LocalLeaseFile(str(tmp_path / "x.lease.json"), str(tmp_path / "x.lease.lock"))
    assert lease.create(b"one")
    held = os.open(lease.lock_path, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # someone holds the lock
    inside: list[tuple[bool, int]] = []

    def waiter() -> None:
        with lease._locked():
            # Holding a lock on the file that is at the path, not on a removed one.
            inside.append((os.path.exists(lease.lock_path), os.stat(lease.lock_path).st_ino))

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.2)
    assert not inside  # blocked behind the holder
    os.remove(lease.lock_path)  # what delete() does, while still holding the lock
    fcntl.flock(held, fcntl.LOCK_UN)
    os.close(held)
    thread.join(timeout=10)
    assert inside and inside[0][0]
    # The waiter woke on the removed file, saw it gone and locked the file now at the path.
    assert inside[0][1] == os.stat(lease.lock_path).st_ino
    assert lease.delete(b"one") and not os.path.exists(lease.lock_path)
