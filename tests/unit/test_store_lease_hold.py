"""Tests of ``store.lease.hold``, the one context manager a driver takes a store with: it
acquires, renews when due, and releases however the block ends (a failed release is logged)."""

from __future__ import annotations

import logging
import time

import pytest

from classgrad.errors import LeaseHeldError, StoreError
from classgrad.store import StoreSpec, create_store, open_store


def make_store(tmp_path):
    spec = StoreSpec(num_classes=8, dim=4, shard_rows=4, row_chunk=4, fingerprint="fp-hold")
    return create_store(str(tmp_path / "s"), spec)


def test_hold_acquires_renews_when_due_and_releases(tmp_path):
    store = make_store(tmp_path)
    with store.lease.hold("run-a", ttl_s=60.0, info={"command": "test"}) as lease:
        held = store.lease.info()
        assert held["run_id"] == "run-a" and held["ttl_s"] == 60.0 and held["info"] == {"command": "test"}
        lease.keep_alive()  # a third of the TTL has not passed: nothing written
        assert store.lease.info()["heartbeat"] == held["heartbeat"]
        lease.renew_every_s = 0.0
        time.sleep(0.01)  # so that the new heartbeat (time.time()) is later than the first
        lease.keep_alive()
        assert store.lease.info()["heartbeat"] > held["heartbeat"]
        with pytest.raises(LeaseHeldError):
            open_store(store.url, mode="r+").lease.acquire("run-b")
    assert store.lease.info() is None


def test_hold_releases_when_the_block_raises(tmp_path):
    store = make_store(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        with store.lease.hold("run-a"):
            raise KeyboardInterrupt
    assert store.lease.info() is None


def test_hold_is_refused_while_another_run_holds_the_store(tmp_path):
    store = make_store(tmp_path)
    store.lease.acquire("run-a", ttl_s=60.0)
    entered = False
    with pytest.raises(LeaseHeldError, match="in use by run 'run-a'"):
        with open_store(store.url, mode="r+").lease.hold("run-b"):
            entered = True
    assert not entered and store.lease.info()["run_id"] == "run-a"  # left alone


def test_a_failed_release_is_logged_not_raised(tmp_path, caplog, monkeypatch):
    store = make_store(tmp_path)

    def fail(run_id: str) -> None:
        raise StoreError("cannot release the lease of somewhere: disk gone")

    with caplog.at_level(logging.ERROR, logger="classgrad.store"):
        with store.lease.hold("run-a") as lease:
            monkeypatch.setattr(store.lease, "release", fail)
            assert lease.run_id == "run-a"
    assert "could not release the store's lease: cannot release the lease of somewhere" in caplog.text
