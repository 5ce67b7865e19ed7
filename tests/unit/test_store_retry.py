"""Retries of store I/O (``classgrad.store.core.retry``): which errors are sent again, how
long the backoff waits, what is raised once the tries are spent, and the row writer's use of it."""

from __future__ import annotations

import errno

import numpy as np
import pytest
from aiohttp import ServerDisconnectedError
from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError, ReadTimeoutError

from classgrad.errors import LeaseHeldError, StoreError, StoreUnavailableError
from classgrad.store import StoreSpec, create_store
from classgrad.store.core.retry import STORE_RETRY, RetryPolicy, io_error, is_transient, retry_transient
from classgrad.store.rows import writer

URL = "http://127.0.0.1:9/b/x.zarr/grads/c/0/0"


def client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
    )


def caused(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


TRANSIENT = {
    "connection refused": EndpointConnectionError(endpoint_url=URL),
    "connection closed": ConnectionClosedError(endpoint_url=URL),
    "read timeout": ReadTimeoutError(endpoint_url=URL),
    "server disconnected": ServerDisconnectedError(),
    "reset socket": ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    "timeout": TimeoutError("timed out"),
    "SlowDown": client_error("SlowDown", 503),
    "429": client_error("TooManyRequests", 429),
    "500": client_error("InternalError", 500),
    "SlowDown as s3fs raises it": caused(
        OSError(errno.EBUSY, "Please reduce your request rate."), client_error("SlowDown", 503)
    ),
    "an unknown code s3fs calls EIO": caused(OSError(errno.EIO, "Rate exceeded"), client_error("Throttling", 400)),
    "wrapped socket error": caused(RuntimeError("zarr gave up"), ConnectionRefusedError(errno.ECONNREFUSED, "refused")),
    "a store still unreachable": StoreUnavailableError("cannot write rows [0, 8) to s3://b/x.zarr: ..."),
}
NOT_TRANSIENT = {
    "access denied": caused(PermissionError("Access Denied"), client_error("AccessDenied", 403)),
    "no such bucket": caused(
        FileNotFoundError("The specified bucket does not exist"), client_error("NoSuchBucket", 404)
    ),
    "AccessDenied unwrapped": client_error("AccessDenied", 403),
    "disk full": OSError(errno.ENOSPC, "No space left on device"),
    "quota": OSError(errno.EDQUOT, "Disk quota exceeded"),
    "read-only file system": OSError(errno.EROFS, "Read-only file system"),
    "EIO from a disk": OSError(errno.EIO, "Input/output error"),
    "a bug": ValueError("operands could not be broadcast together"),
    "a store error": StoreError("write_rows: row 3 (class 3) has non-finite values; refusing to store it"),
    "a lost lease": LeaseHeldError("run 'a' no longer holds the lease"),
    "denied, whatever the socket said before": caused(PermissionError("denied"), ConnectionResetError()),
}


@pytest.mark.parametrize("exc", TRANSIENT.values(), ids=TRANSIENT.keys())
def test_errors_that_pass_are_transient(exc):
    assert is_transient(exc)


@pytest.mark.parametrize("exc", NOT_TRANSIENT.values(), ids=NOT_TRANSIENT.keys())
def test_errors_that_cannot_pass_are_not(exc):
    assert not is_transient(exc)


class FakeTime:
    """A clock that only the retry helper's sleeps move."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


def failing(errors: list[BaseException], result: str = "ok"):
    calls = []

    def call() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return result

    return call, calls


POLICY = RetryPolicy(tries=6, first_delay_s=0.5, max_delay_s=3.0, total_s=100.0)


def test_transient_errors_are_retried_with_growing_jittered_waits_until_the_call_succeeds():
    fake = FakeTime()
    call, calls = failing([ConnectionResetError() for _ in range(5)])
    assert retry_transient(call, "test", policy=POLICY, sleep=fake.sleep, clock=fake.clock) == "ok"
    assert len(calls) == 6
    # Each wait lies in the upper half of its step (jitter), steps double from 0.5 s up to the 3 s cap.
    for wait, top in zip(fake.waits, [0.5, 1.0, 2.0, 3.0, 3.0]):
        assert top / 2 <= wait <= top


def test_the_last_error_is_raised_once_the_tries_are_spent():
    fake = FakeTime()
    errors = [client_error("SlowDown", 503) for _ in range(10)]
    last = errors[POLICY.tries - 1]
    call, calls = failing(errors)
    with pytest.raises(ClientError) as info:
        retry_transient(call, "test", policy=POLICY, sleep=fake.sleep, clock=fake.clock)
    assert info.value is last and len(calls) == POLICY.tries and len(fake.waits) == POLICY.tries - 1
    assert info.value.tries == POLICY.tries and info.value.seconds == pytest.approx(sum(fake.waits))
    message = str(io_error("cannot write rows [0, 8) to s3://b/x.zarr", info.value))
    assert isinstance(io_error("x", info.value), StoreUnavailableError)
    assert message.startswith("cannot write rows [0, 8) to s3://b/x.zarr: still failing after 6 tries in ")
    assert message.endswith("ClientError: An error occurred (SlowDown) when calling the PutObject operation: SlowDown")


def test_no_try_starts_after_the_time_bound():
    fake = FakeTime()
    call, calls = failing([TimeoutError() for _ in range(100)])
    policy = RetryPolicy(tries=100, first_delay_s=1.0, max_delay_s=8.0, total_s=20.0)
    with pytest.raises(TimeoutError):
        retry_transient(call, "test", policy=policy, sleep=fake.sleep, clock=fake.clock)
    assert fake.now <= policy.total_s and len(calls) < policy.tries


@pytest.mark.parametrize(
    "exc", [OSError(errno.ENOSPC, "No space left on device"), PermissionError("denied"), ValueError("x")]
)
def test_errors_that_cannot_pass_are_raised_at_once(exc):
    fake = FakeTime()
    call, calls = failing([exc])
    with pytest.raises(type(exc)) as info:
        retry_transient(call, "test", policy=POLICY, sleep=fake.sleep, clock=fake.clock)
    assert info.value is exc and len(calls) == 1 and fake.waits == []
    error = io_error("cannot write rows [0, 8) to /d/x.zarr", exc)
    assert type(error) is StoreError and "after" not in str(error)


def test_the_store_policy_is_bounded():
    # At most a few seconds of waits per request, so a store that stays down reaches the
    # driver's shard retries soon, and a time bound on top.
    waits = sum(min(STORE_RETRY.max_delay_s, STORE_RETRY.first_delay_s * 2**i) for i in range(STORE_RETRY.tries - 1))
    assert 2 <= STORE_RETRY.tries <= 10 and waits <= 10 and STORE_RETRY.total_s <= 60


def small_store(path):
    spec = StoreSpec(num_classes=16, dim=6, shard_rows=8, row_chunk=4, col_chunk=6, fingerprint="fp")
    return create_store(str(path), spec)


def test_the_row_writer_rides_out_transient_errors(tmp_path, monkeypatch):
    store = small_store(tmp_path / "s.zarr")
    real = writer.write_direct
    errors: list[BaseException] = [ConnectionResetError(errno.ECONNRESET, "reset"), client_error("SlowDown", 503)]

    def flaky(*args, **kwargs):
        if errors:
            raise errors.pop(0)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "write_direct", flaky)
    rows = np.arange(48, dtype=np.float32).reshape(8, 6)
    store.write_rows(0, rows, loss=np.ones(8), count=np.ones(8))
    store.mark_shard_done(0)
    assert errors == [] and np.array_equal(store.rows(range(8)), rows)


def test_a_full_disk_fails_the_write_at_once_and_is_not_retryable(tmp_path, monkeypatch):
    store = small_store(tmp_path / "s.zarr")
    calls = []

    def full(*args, **kwargs):
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "write_direct", full)
    with pytest.raises(StoreError) as info:
        store.write_rows(0, np.ones((8, 6)), loss=np.ones(8), count=np.ones(8))
    assert len(calls) == 1 and not info.value.retryable
    assert (
        str(info.value)
        == f"cannot write rows [0, 8) to {tmp_path / 's.zarr'}: OSError: [Errno 28] No space left on device"
    )
