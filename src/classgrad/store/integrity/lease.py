"""The running driver's lease on a store: one run at a time, taken before the store is touched.

Holds ``StoreLease`` (``GradStore.lease``, or ``store_lease(url)`` before a store exists:
``info``, ``check_free`` (a read: refused while another run's lease is live), ``acquire``,
``renew``, ``release`` and ``hold``, the one context manager a driver takes the store with),
``HeldLease`` (what ``hold`` yields: ``keep_alive`` renews the heartbeat
when it is due, ``confirm`` renews at once and so proves the lease is still held) and the
helpers ``read_lease``, ``lease_age``, ``lease_state`` (live, expired, or its holder's process
gone) and ``held_message``.

The lease is a JSON file next to the store, outside what an overwrite deletes
(``STORE.classgrad-lease.json``; see ``format``): run_id, host, pid, started, heartbeat, ttl_s
(the holder's promise to renew within it) and info. Taking, renewing, taking over and releasing
it are atomic on local disks and S3 (``lease_files``: exclusive create plus an fcntl lock;
conditional PUTs); on other fsspec filesystems it is best effort (write, read back). Transient
I/O errors are sent again (``retry``); a conditional write whose earlier try went through after
all reads back as this run's lease and counts as done.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator

from classgrad.errors import ClassgradError, LeaseHeldError, StoreError, StoreUnavailableError
from classgrad.store.core.format import LEASE_LOCK_SUFFIX, LEASE_SUFFIX
from classgrad.store.core.location import Location
from classgrad.store.core.retry import io_error, retry_transient
from classgrad.store.integrity.lease_files import LeaseFile, lease_file

log = logging.getLogger(__name__)

_ATTEMPTS = 5  # compare-and-swap rounds before a contended acquire gives up


def _file(loc: Location) -> LeaseFile:
    return lease_file(loc.fs, loc.sibling(LEASE_SUFFIX), local=loc.local, lock_path=loc.sibling(LEASE_LOCK_SUFFIX))


def _parse(data: bytes | None, url: str) -> dict | None:
    if data is None:
        return None
    try:
        lease = json.loads(data)
    except ValueError:
        log.warning("ignoring an unreadable lease file of %s", url)
        return None
    return lease if isinstance(lease, dict) else None


def _read(loc: Location, file: LeaseFile) -> tuple[dict | None, bool, object]:
    """(the lease or None, whether a file exists, its version)."""
    try:
        data, version = retry_transient(file.read, f"reading the lease of {loc.url}")
    except Exception as exc:  # OSError, or a botocore error (an unreachable endpoint) on S3
        # The lease is the first thing read at a location: say so in the words ``probe`` uses.
        raise io_error(f"cannot read store location {loc.url}", exc) from None
    return _parse(data, loc.url), data is not None, version


def read_lease(loc: Location) -> dict | None:
    """The lease of the store at ``loc``, or None (none, or unreadable: then it is ignored with a warning)."""
    return _read(loc, _file(loc))[0]


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


def lease_state(lease: dict, now: float) -> tuple[str, str]:
    """("live" | "expired" | "holder_gone", a line that says why) for ``classgrad status``."""
    if _holder_gone(lease):
        return "holder_gone", f"its driver process (pid {lease.get('pid')}) no longer exists on this host"
    age, ttl = lease_age(lease, now), float(lease.get("ttl_s", 0))
    if age >= ttl:
        return "expired", f"its last heartbeat was {age:.0f}s ago, past its {ttl:.0f}s TTL"
    return "live", f"last heartbeat {age:.0f}s ago (TTL {ttl:.0f}s)"


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

    @property
    def url(self) -> str:
        return self._lease.url

    def keep_alive(self) -> None:
        """Refresh the heartbeat if ``renew_every_s`` has passed since the last one;
        ``LeaseHeldError`` if another run has taken the lease. A renewal that fails on an
        unreachable store is tried again on the next call, until two periods have passed."""
        since = time.monotonic() - self._renewed
        if since > self.renew_every_s:
            try:
                self.confirm()
            except StoreUnavailableError as exc:
                # The heartbeat is renewed every third of the TTL: a missed renewal leaves time.
                if since > 2 * self.renew_every_s:
                    raise
                log.warning("could not renew the lease (%s); trying again", exc)

    def confirm(self) -> None:
        """Renew now: ``LeaseHeldError`` unless this run still holds the lease."""
        self._lease.renew(self.run_id)
        self._renewed = time.monotonic()

    def release(self) -> None:
        """Give the lease back (left alone if another run holds it by now)."""
        self._lease.release(self.run_id)


class StoreLease:
    """The lease of one store (``GradStore.lease``, or ``store_lease`` before the store exists)."""

    def __init__(self, loc: Location, *, writable: bool) -> None:
        self._loc = loc
        self._writable = writable
        self._file = _file(loc)

    @property
    def url(self) -> str:
        return self._loc.url

    def _require_writable(self) -> None:
        if not self._writable:
            raise StoreError(f"store {self._loc.url} is open read-only; open it with mode='r+'")

    def _change(self, what: str, call: Callable[..., bool], *args: object) -> bool:
        """A conditional write of the lease file, sent again on transient errors. False when its
        condition failed: another run changed the file, or an earlier try of ours went through
        (callers read the lease back to tell which)."""
        try:
            return retry_transient(lambda: call(*args), f"{what} the lease of {self._loc.url}")
        except Exception as exc:  # OSError, or a botocore error (an unreachable endpoint) on S3
            raise io_error(f"cannot {what} the lease of {self._loc.url}", exc) from None

    def info(self) -> dict | None:
        """The current lease (run_id, host, pid, started, heartbeat, ttl_s, info), or None."""
        return _read(self._loc, self._file)[0]

    def check_free(self, run_id: str) -> None:
        """``LeaseHeldError`` now if another run's lease is live (a read only: ``acquire`` is what
        takes it). A driver calls this before its slow checks, so a second driver is refused at
        once rather than after building the model."""
        current = self.info()
        now = time.time()
        if current and current.get("run_id") != run_id and lease_state(current, now)[0] == "live":
            raise LeaseHeldError(held_message(self._loc.url, current, now))

    def acquire(self, run_id: str, *, ttl_s: float = 60.0, info: dict | None = None) -> None:
        """Take the store for run ``run_id``: refused while another run's lease is fresh
        (heartbeat younger than the TTL its holder wrote into it, this run's ``ttl_s`` only for a
        lease without one) and its holder alive; a stale one is taken over with a warning. The
        holder may re-acquire. Atomic: of two runs taking the same lease, one gets it."""
        self._require_writable()
        url = self._loc.url
        for _ in range(_ATTEMPTS):
            current, exists, version = _read(self._loc, self._file)
            now = time.time()
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
            data = json.dumps(lease).encode()
            if exists:
                taken = self._change("take", self._file.replace, data, version)
            else:
                taken = self._change("take", self._file.create, data)
            if taken:
                return
            # Another run changed the lease between our read and our write: judge its lease.
        back = self.info()
        raise LeaseHeldError(held_message(url, back or {}, time.time()))

    def renew(self, run_id: str) -> None:
        """Refresh the heartbeat; ``LeaseHeldError`` if another run has taken the lease."""
        self._require_writable()
        current, _, version = _read(self._loc, self._file)
        if current and current.get("run_id") == run_id:
            current["heartbeat"] = time.time()
            data = json.dumps(current).encode()
            if self._change("renew", self._file.replace, data, version):
                return
            current = self.info()  # taken over between the read and the write, or our retry's first try won
            if current and current.get("run_id") == run_id:
                return
        taker = f"run {current.get('run_id')!r}" if current else "nobody (it was released)"
        raise LeaseHeldError(f"run {run_id!r} lost its lease on {self._loc.url}: now held by {taker}")

    def release(self, run_id: str) -> None:
        """Drop the lease if ``run_id`` holds it (another run's lease is left alone)."""
        self._require_writable()
        current, exists, version = _read(self._loc, self._file)
        if not exists:
            return
        if not current or current.get("run_id") != run_id:
            log.warning(
                "not releasing the lease on %s: it is held by run %r, not %r",
                self._loc.url,
                (current or {}).get("run_id"),
                run_id,
            )
            return
        if not self._change("release", self._file.delete, version):
            after = self.info()
            if after and after.get("run_id") != run_id:
                log.warning("not releasing the lease on %s: another run took it over meanwhile", self._loc.url)

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


def store_lease(url: str, *, storage_options: dict | None = None) -> StoreLease:
    """The lease of the store at ``url``, which need not exist yet: a driver takes it first
    (refused for a local path that is a symbolic link)."""
    loc = Location(url, storage_options)
    loc.refuse_link()
    return StoreLease(loc, writable=True)
