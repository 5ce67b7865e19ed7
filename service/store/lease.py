"""The running driver's lease on a store: one run at a time, and a stale one taken over.

Holds ``StoreLease`` (``GradStore.lease``: ``info``, ``acquire``, ``renew``, ``release`` and
``hold``, the one context manager a driver takes the store with), ``HeldLease`` (what ``hold``
yields: ``keep_alive`` renews the heartbeat when it is due) and the helpers ``read_lease``,
``lease_age`` and ``held_message`` (also used by ``create_store`` before an overwrite).

The lease is ``lease.json`` at the store's root (plain JSON, not Zarr; readers ignore it):
run_id, host, pid, started, heartbeat, ttl_s (the holder's promise to renew within it) and info.
Best effort (read, write, read back), not a distributed lock: it stops a second driver started
by mistake, which is what it is for.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator

from classgrad.service.errors import ClassgradError, LeaseHeldError, StoreError, StoreUnavailableError
from classgrad.service.store.format import LEASE_KEY
from classgrad.service.store.location import Location
from classgrad.service.store.retry import io_error, retry_transient

log = logging.getLogger(__name__)


def read_lease(loc: Location) -> dict | None:
    """The lease at ``loc``, or None (none, or unreadable: then it is ignored with a warning)."""
    try:
        data = retry_transient(lambda: loc.read_bytes(LEASE_KEY), f"reading the lease of {loc.url}")
    except Exception as exc:  # botocore's connection errors are no OSErrors
        raise io_error(f"cannot read the lease of {loc.url}", exc) from None
    if data is None:
        return None
    try:
        lease = json.loads(data)
    except ValueError:
        log.warning("ignoring an unreadable lease file in %s", loc.url)
        return None
    return lease if isinstance(lease, dict) else None


def lease_age(lease: dict, now: float) -> float:
    return now - float(lease.get("heartbeat", 0))


def _holder_gone(lease: dict) -> bool:
    """True when the lease's driver ran on this host and its process no longer exists.

    A killed driver (SIGKILL, OOM) cannot release its lease; on the same host that is
    provable at once, so a rerun need not wait for the heartbeat to age past the TTL.
    """
    if lease.get("host") != socket.gethostname() or not isinstance(lease.get("pid"), int):
        return False
    try:
        os.kill(lease["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by someone else
        return False
    return False


def held_message(url: str, lease: dict, now: float) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lease.get("started", 0)))
    return (
        f"store {url} is in use by run {lease.get('run_id')!r} (host {lease.get('host')}, "
        f"pid {lease.get('pid')}, started {started}, last heartbeat "
        f"{lease_age(lease, now):.0f}s ago); wait for it to finish or stop it"
    )


class HeldLease:
    """A lease taken by ``StoreLease.hold``: call ``keep_alive`` often; it renews when due."""

    def __init__(self, lease: StoreLease, run_id: str, renew_every_s: float) -> None:
        self.run_id = run_id
        self.renew_every_s = renew_every_s
        self._lease = lease
        self._renewed = time.monotonic()

    def keep_alive(self) -> None:
        """Refresh the heartbeat if ``renew_every_s`` has passed since the last one;
        ``LeaseHeldError`` if another run has taken the lease. A renewal that fails on an
        unreachable store is tried again on the next call, until two periods have passed."""
        since = time.monotonic() - self._renewed
        if since > self.renew_every_s:
            try:
                self._lease.renew(self.run_id)
            except StoreUnavailableError as exc:
                # The heartbeat is renewed every third of the TTL: a missed renewal leaves time.
                if since > 2 * self.renew_every_s:
                    raise
                log.warning("could not renew the lease (%s); trying again", exc)
                return
            self._renewed = time.monotonic()


class StoreLease:
    """The lease of one open store (``GradStore.lease``)."""

    def __init__(self, loc: Location, *, writable: bool) -> None:
        self._loc = loc
        self._writable = writable

    def _require_writable(self) -> None:
        if not self._writable:
            raise StoreError(f"store {self._loc.url} is open read-only; open it with mode='r+'")

    def _write(self, lease: dict) -> None:
        data = json.dumps(lease).encode()
        try:
            retry_transient(lambda: self._loc.write_bytes(LEASE_KEY, data), f"writing the lease of {self._loc.url}")
        except Exception as exc:
            raise io_error(f"cannot write the lease of {self._loc.url}", exc) from None

    def info(self) -> dict | None:
        """The current lease (run_id, host, pid, started, heartbeat, ttl_s, info), or None."""
        return read_lease(self._loc)

    def acquire(self, run_id: str, *, ttl_s: float = 60.0, info: dict | None = None) -> None:
        """Take the store for run ``run_id``: refused while another run's lease is fresh
        (heartbeat younger than the TTL its holder wrote into it, this run's ``ttl_s`` only for a
        lease without one); a stale one is taken over with a warning. The holder may re-acquire.
        """
        self._require_writable()
        url = self._loc.url
        now = time.time()
        current = read_lease(self._loc)
        if current and current.get("run_id") != run_id:
            age = lease_age(current, now)
            gone = _holder_gone(current)
            held_for = float(current.get("ttl_s", ttl_s))  # the holder's promise, not the newcomer's
            if age < held_for and not gone:
                raise LeaseHeldError(held_message(url, current, now))
            why = "its driver process is gone" if gone else f"last heartbeat {age:.0f}s ago > {held_for:.0f}s"
            log.warning(
                "taking over the stale lease of run %r on %s (host %s, pid %s): %s",
                current.get("run_id"),
                url,
                current.get("host"),
                current.get("pid"),
                why,
            )
        started = now
        if current and current.get("run_id") == run_id:  # the holder re-acquiring keeps its start
            started = current["started"]
        lease = {
            "run_id": run_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": started,
            "heartbeat": now,
            "ttl_s": ttl_s,
            "info": json.loads(json.dumps(info or {}, default=str)),
        }
        self._write(lease)
        back = read_lease(self._loc)
        if not back or back.get("run_id") != run_id:  # another driver wrote in between
            raise LeaseHeldError(held_message(url, back or {}, time.time()))

    def renew(self, run_id: str) -> None:
        """Refresh the heartbeat; ``LeaseHeldError`` if another run has taken the lease."""
        self._require_writable()
        current = read_lease(self._loc)
        if not current or current.get("run_id") != run_id:
            taker = f"run {current.get('run_id')!r}" if current else "nobody (it was released)"
            raise LeaseHeldError(f"run {run_id!r} lost its lease on {self._loc.url}: now held by {taker}")
        current["heartbeat"] = time.time()
        self._write(current)

    def release(self, run_id: str) -> None:
        """Drop the lease if ``run_id`` holds it (another run's lease is left alone)."""
        self._require_writable()
        current = read_lease(self._loc)
        if current is None:
            return
        if current.get("run_id") != run_id:
            log.warning(
                "not releasing the lease on %s: it is held by run %r, not %r",
                self._loc.url,
                current.get("run_id"),
                run_id,
            )
            return
        try:
            retry_transient(lambda: self._loc.delete(LEASE_KEY), f"releasing the lease of {self._loc.url}")
        except Exception as exc:
            raise io_error(f"cannot release the lease of {self._loc.url}", exc) from None

    @contextlib.contextmanager
    def hold(
        self, run_id: str, *, ttl_s: float = 60.0, info: dict | None = None, renew_every_s: float | None = None
    ) -> Iterator[HeldLease]:
        """``with store.lease.hold(run_id, ttl_s=...) as lease:`` acquire, yield a ``HeldLease``
        (``lease.keep_alive()`` renews every ``renew_every_s``, default a third of the TTL) and
        release on the way out, however the block ends. A release that fails is logged, not
        raised: it must not hide the block's own error, and the run's work is saved already."""
        self.acquire(run_id, ttl_s=ttl_s, info=info)
        try:
            yield HeldLease(self, run_id, ttl_s / 3 if renew_every_s is None else renew_every_s)
        finally:
            try:
                self.release(run_id)
            except ClassgradError as exc:
                log.error("could not release the store's lease: %s", exc)
