"""Retries of store I/O that failed for a reason that passes: throttling, a lost connection, a timeout.

Holds ``RetryPolicy`` and ``STORE_RETRY`` (the store's policy: how many tries, the backoff and the
time bound), ``is_transient`` (may an error pass if the same request is sent again?),
``retry_transient`` (call a function, retrying it on transient errors with bounded exponential
backoff and jitter; the last error is raised as it came) and ``io_error`` (the one-line store
error for that last error).

Only idempotent requests are retried (whole chunks, whole objects, the lease file): sending one
twice leaves the store as sending it once. Object stores throttle (S3 ``SlowDown``, 503, 429) and
restart (connections refused or reset, timeouts); the client libraries retry a little on their
own (botocore, s3fs), and this is the layer above them, in the store, on the write paths. Errors
that cannot pass are raised at once: permission denied, no such bucket or key, a full disk
(``ENOSPC``), and everything that is not I/O (a non-finite row, a misaligned write, a bug).
A transient error whose tries are spent becomes ``StoreUnavailableError``, which the driver
retries as a failed shard (``sharding.max_attempts``) before it fails the job.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from classgrad.errors import ClassgradError, StoreError, StoreUnavailableError, first_line

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Tries of one request: waits of ``first_delay_s``, doubling up to ``max_delay_s``, each
    drawn uniformly from its upper half (jitter: writers that failed together do not retry
    together); no new try starts once ``total_s`` have passed since the first."""

    tries: int
    first_delay_s: float
    max_delay_s: float
    total_s: float

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """The wait before retry number ``retry`` (1 for the first retry)."""
        top = min(self.max_delay_s, self.first_delay_s * 2 ** (retry - 1))
        return top * (0.5 + 0.5 * (rng or random).random())


# 5 tries over at most 0.25 + 0.5 + 1 + 2 = 3.75 s of waits: enough to ride out throttling and an
# endpoint that restarts on top of the client's own retries, short enough that a store that stays
# down reaches the driver's shard retries soon.
STORE_RETRY = RetryPolicy(tries=5, first_delay_s=0.25, max_delay_s=4.0, total_s=30.0)

# errno values of errors that pass: connections refused, reset or timed out, a busy server (s3fs
# turns S3's SlowDown and 503 into EBUSY, 500 InternalError into EREMOTEIO).
_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EAGAIN",
        "EBUSY",
        "ECONNABORTED",
        "ECONNREFUSED",
        "ECONNRESET",
        "EHOSTUNREACH",
        "ENETDOWN",
        "ENETRESET",
        "ENETUNREACH",
        "EPIPE",
        "EREMOTEIO",
        "ETIMEDOUT",
    )
    if hasattr(errno, name)
)
# Errors of the client libraries (matched by class name along the class hierarchy, so that the
# store needs none of them installed): botocore's connection errors (refused, closed, timeouts),
# aiohttp's connection and payload errors, fsspec's timeout.
_TRANSIENT_TYPES = frozenset(
    {
        "HTTPClientError",  # botocore: ConnectionClosedError, ReadTimeoutError, ProxyConnectionError...
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "IncompleteReadError",
        "ResponseStreamingError",
        "ClientConnectionError",  # aiohttp: ServerDisconnectedError, ClientOSError...
        "ClientPayloadError",
        "ServerTimeoutError",
        "FSTimeoutError",
    }
)
# S3 error codes and HTTP statuses of a ClientError that pass.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "ServiceUnavailable",
        "InternalError",
        "429",
        "500",
        "502",
        "503",
        "504",
    }
)


def _verdict(exc: BaseException) -> bool | None:
    """True (transient) or False (not) when ``exc`` itself tells, else None (ask its cause)."""
    if isinstance(exc, ClassgradError):
        return exc.retryable
    if isinstance(exc, (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)):
        return False
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & _TRANSIENT_TYPES:
        return True
    if "ClientError" in names:  # botocore: an answer from the server, transient or not by its code
        response = getattr(exc, "response", None) or {}
        code = str((response.get("Error") or {}).get("Code", ""))
        status = str((response.get("ResponseMetadata") or {}).get("HTTPStatusCode", ""))
        return code in _TRANSIENT_CODES or status in _TRANSIENT_CODES
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno is not None:
        # ENOSPC, EDQUOT, EROFS, EACCES...: never; EIO: ask the cause (s3fs's unknown S3 codes).
        return True if exc.errno in _TRANSIENT_ERRNOS else (None if exc.errno == errno.EIO else False)
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` may pass if the same request is sent again: decided by the first error
    along its chain of causes that tells (a library often wraps the socket error it met)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        verdict = _verdict(current)
        if verdict is not None:
            return verdict
        current = current.__cause__ or current.__context__
    return False


def retry_transient(
    call: Callable[[], T],
    what: str,
    *,
    policy: RetryPolicy = STORE_RETRY,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``call()``, sent again after transient errors (``is_transient``) as ``policy`` allows.

    Any other error, and the last transient one once the tries or the time are spent, is raised
    as it came, with ``tries`` and ``seconds`` attributes added (``io_error`` quotes them).
    ``what`` names the request in the log (``write rows [0, 16) of s3://b/x.zarr``).
    """
    t0 = clock()
    tries = 0
    while True:
        tries += 1
        try:
            return call()
        except Exception as exc:
            spent = clock() - t0
            wait = policy.delay(tries)
            if not is_transient(exc) or tries >= policy.tries or spent + wait > policy.total_s:
                with contextlib.suppress(AttributeError):  # an exception with __slots__ keeps none
                    exc.tries, exc.seconds = tries, spent  # type: ignore[attr-defined]
                raise
            log.warning(
                "%s failed (try %d of %d): %s; retrying in %.1f s",
                what,
                tries,
                policy.tries,
                first_line(exc, with_type=True),
                wait,
            )
            sleep(wait)


def io_error(message: str, exc: BaseException) -> StoreError:
    """The store error for an I/O error ``retry_transient`` raised: ``StoreUnavailableError``
    (the driver retries the shard) when it is transient, else ``StoreError`` (the job fails at
    once). Its one line: ``message``, the tries spent, the library's error."""
    tries = getattr(exc, "tries", 1)
    spent = f"still failing after {tries} tries in {getattr(exc, 'seconds', 0.0):.1f} s: " if tries > 1 else ""
    kind = StoreUnavailableError if is_transient(exc) else StoreError
    return kind(f"{message}: {spent}{first_line(exc, with_type=True)}")
