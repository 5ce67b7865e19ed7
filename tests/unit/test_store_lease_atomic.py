"""The store's lease on a local disk: taken before the store exists, atomically, next to the store.

- The lease file is created only if absent and replaced only if unchanged (``LocalLeaseFile``).
- Of many takers started together on a new store, or on a stale lease, exactly one gets it.
- The lease lives next to the store: deleting the store (an overwrite) leaves it held.
- A store that a live lease holder is still creating is never deleted by another creator.
- The driver takes the lease before it creates anything.
- ``classgrad status`` says when the lease's holder process is gone or its lease has expired.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zarr

from classgrad.config import JobConfig
from classgrad.errors import LeaseHeldError
from classgrad.service.commands.cli import main as cli_main
from classgrad.service.driver_runtime.driver import JobDriver
from classgrad.store import StoreSpec, create_store, store_lease
from classgrad.store.integrity.lease_files import LocalLeaseFile
from tests.support.jobs import small_job
from tests.support.stores import write_all


def spec(fingerprint: str = "fp-1") -> StoreSpec:
    return StoreSpec(num_classes=8, dim=4, shard_rows=4, row_chunk=4, fingerprint=fingerprint)


def lease_path(tmp_path, name: str = "s") -> str:
    return str(tmp_path / f"{name}.classgrad-lease.json")


def test_the_local_lease_file_creates_only_if_absent_and_replaces_only_if_unchanged(tmp_path):
    path = lease_path(tmp_path)
    file = LocalLeaseFile(path, str(tmp_path / "s.classgrad-lease.lock"))
    assert file.read() == (None, None)
    assert file.create(b"first") and not file.create(b"second")
    data, version = file.read()
    assert data == b"first"
    assert file.replace(b"renewed", version)
    assert not file.replace(b"stale", version)  # the version read before the renewal
    assert not file.delete(version)
    assert file.read()[0] == b"renewed" and file.delete(file.read()[1])
    assert file.read() == (None, None)
    # No temporary file is left beside it, nor the lock file: it goes with the lease (a waiter
    # on the removed file locks the new one: tests/unit/test_lease_lock_file.py).
    assert sorted(os.listdir(tmp_path)) == []


def _race(take, n: int) -> list[str]:
    """Run ``take(i)`` in n threads released together; return what each said."""
    barrier, said = threading.Barrier(n), [""] * n

    def one(i: int) -> None:
        barrier.wait()
        try:
            take(i)
            said[i] = "won"
        except LeaseHeldError:
            said[i] = "refused"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return said


def test_of_many_takers_of_a_new_store_exactly_one_gets_the_lease(tmp_path):
    for trial in range(10):
        url = str(tmp_path / f"t{trial}" / "s.zarr")
        said = _race(lambda i, url=url: store_lease(url).acquire(f"run-{i}", ttl_s=60.0), 8)
        assert said.count("won") == 1, said
        assert store_lease(url).info()["run_id"] == f"run-{said.index('won')}"
        assert not os.path.exists(url)  # taking the lease creates nothing in the store's place


def test_of_many_takers_of_a_stale_lease_exactly_one_takes_it_over(tmp_path):
    url = str(tmp_path / "s.zarr")
    for trial in range(10):
        store_lease(url).acquire(f"stale-{trial}", ttl_s=0.0)  # stale at once
        said = _race(lambda i, trial=trial: store_lease(url).acquire(f"run-{trial}-{i}", ttl_s=60.0), 8)
        assert said.count("won") == 1, said
        holder = store_lease(url).info()
        store_lease(url).release(holder["run_id"])


def test_the_lease_is_next_to_the_store_and_survives_its_overwrite(tmp_path):
    url = str(tmp_path / "s.zarr")
    with store_lease(url).hold("run-a") as held:
        assert os.path.exists(str(tmp_path / "s.zarr.classgrad-lease.json"))
        store = create_store(url, spec("fp-1"), lease=held)
        write_all(store, np.ones((store.num_classes, store.dim), np.float32), shards=[0])  # rows, then the mark
        new = create_store(url, spec("fp-2"), overwrite=True, lease=held)
        assert new.fingerprint == "fp-2" and not new.shard_done.any()
        assert new.lease.info()["run_id"] == "run-a"  # the deletion of the store left it alone
        held.confirm()
        assert not os.path.exists(os.path.join(url, "lease.json"))
    assert store_lease(url).info() is None


def test_create_store_under_a_lease_refuses_a_lease_another_run_holds(tmp_path):
    url = str(tmp_path / "s.zarr")
    with store_lease(url).hold("run-a", ttl_s=0.0) as held:  # stale at once
        store_lease(url).acquire("run-b", ttl_s=60.0)  # taken over
        with pytest.raises(LeaseHeldError, match="run 'run-a' lost its lease .* run 'run-b'"):
            create_store(url, spec(), lease=held)
    assert not os.path.exists(url)


def test_a_store_being_created_by_a_live_lease_holder_is_never_deleted(tmp_path):
    url = str(tmp_path / "s.zarr")
    create_store(url, spec("fp-1"))
    group = zarr.open_group(url, mode="r+")
    group.update_attributes({"classgrad": dict(group.attrs["classgrad"], state="creating")})
    before = sorted(os.listdir(url))
    # A live driver (this process) holds the lease while it creates the store.
    store_lease(url).acquire("creator", ttl_s=60.0)
    for overwrite in (False, True):
        with pytest.raises(LeaseHeldError, match="in use by run 'creator'"):
            create_store(url, spec("fp-2"), overwrite=overwrite)
    assert sorted(os.listdir(url)) == before
    assert zarr.open_group(url, mode="r").attrs["classgrad"]["fingerprint"] == "fp-1"
    # Once the creator is gone (its lease released), a half-created store is recreated.
    store_lease(url).release("creator")
    assert create_store(url, spec("fp-2")).fingerprint == "fp-2"


def _status(url: str, capsys) -> tuple[str, dict]:
    assert cli_main(["status", url]) == 0
    text = capsys.readouterr().out
    assert cli_main(["status", url, "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


def test_status_says_when_the_lease_holder_is_gone_or_its_lease_expired(tmp_path, capsys):
    url = str(tmp_path / "s.zarr")
    create_store(url, spec())
    lease = {
        "run_id": "run-x",
        "host": socket.gethostname(),
        "pid": os.getpid(),  # alive: this process
        "started": time.time(),
        "heartbeat": time.time(),
        "ttl_s": 60.0,
        "info": {},
    }
    path = lease_path(tmp_path, "s.zarr")

    def write(**changes) -> None:
        with open(path, "w") as fh:
            json.dump({**lease, **changes}, fh)

    write()
    text, info = _status(url, capsys)
    assert info["lease_state"] == "live" and "live: last heartbeat" in text and "takes it over" not in text

    write(heartbeat=time.time() - 120.0)  # two minutes without a heartbeat, with a 60 s TTL
    text, info = _status(url, capsys)
    assert info["lease_state"] == "expired" and "past its 60s TTL" in info["lease_state_detail"]
    assert "EXPIRED: its last heartbeat was 120s ago, past its 60s TTL; a rerun takes it over" in text

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write(pid=int(dead.stdout))  # a real process that has exited
    text, info = _status(url, capsys)
    assert info["lease_state"] == "holder_gone" and info["lease"]["pid"] == int(dead.stdout)
    assert f"HOLDER GONE: its driver process (pid {int(dead.stdout)}) no longer exists on this host" in text

    write(host="another-host", pid=1)  # another host: its process cannot be checked from here
    assert _status(url, capsys)[1]["lease_state"] == "live"
    os.remove(path)
    text, info = _status(url, capsys)
    assert info["lease"] is None and info["lease_state"] is None
    assert not any(line.startswith("lease") for line in text.splitlines())


def test_the_driver_takes_the_lease_before_it_creates_the_store(tmp_path):
    url = str(tmp_path / "new.zarr")
    config = JobConfig.model_validate(small_job(url))
    store_lease(url).acquire("run-other", ttl_s=60.0)  # a live driver (this process) took the new store
    with pytest.raises(LeaseHeldError, match="in use by run 'run-other'"):
        JobDriver(config).run()  # refused at the lease: before Ray, before any store exists
    assert not os.path.exists(url)
    assert store_lease(url).info()["run_id"] == "run-other"


def test_check_free_refuses_only_another_runs_live_lease(tmp_path):
    """The driver's early check (before it builds the model) is a read that judges the lease as
    ``acquire`` would: another run's live lease is refused, a stale one or its own is not."""
    url = str(tmp_path / "s.zarr")
    lease = store_lease(url)
    lease.check_free("run-b")  # no lease at all
    lease.acquire("run-a", ttl_s=60.0)
    lease.check_free("run-a")  # its own
    with pytest.raises(LeaseHeldError, match="is in use by run 'run-a'"):
        lease.check_free("run-b")
    lease.release("run-a")
    lease.acquire("run-a", ttl_s=0.0)  # stale at once: acquire would take it over
    lease.check_free("run-b")
    assert lease.info()["run_id"] == "run-a"  # a read only: nothing was taken
