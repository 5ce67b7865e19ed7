"""How the driver reads Ray's failure texts: the one line it reports, whether an actor died
of a user error (fail at once) or of something a replacement can fix, and whether a shard's
error is retried."""

from __future__ import annotations

import collections
import re

import pytest

from classgrad.config import JobConfig
from classgrad.errors import InputError, LeaseHeldError, StoreError, StoreUnavailableError
from classgrad.service.runtime.actor_deaths import cause_line, creation_error
from classgrad.service.runtime.driver import JobDriver
from classgrad.service.runtime.plan import Shard
from tests.support.jobs import small_job

# The text of a real ActorDiedError for a constructor that raised (Ray 2.60), ANSI codes included.
CREATION_FAILED = (
    "The actor died because of an error raised in its creation task, \x1b[36mray::GradientWorker.__init__()"
    "\x1b[39m (pid=28203, ip=192.0.2.2, actor_id=9e7b, repr=<classgrad.workers.runtime.actor.GradientWorker object>)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/work/main/workers/factory.py", line 77, in call_factory\n'
    "    raise InputError(...)\n"
    "classgrad.errors.InputError: model.factory 'x:y' raised ValueError: boom\n"
)
NODE_LOST = (
    "The actor died unexpectedly before finishing this task.\n"
    "\tclass_name: GradientWorker\n\tactor_id: 1234\n"
    "The actor is dead because its node has died. Node Id: abcd\n"
)


class _Err(Exception):
    pass


def test_a_constructor_user_error_is_recognised_and_named():
    err = creation_error(_Err(CREATION_FAILED))
    assert isinstance(err, InputError)
    assert str(err) == "model.factory 'x:y' raised ValueError: boom"
    assert cause_line(_Err(CREATION_FAILED)) == "InputError: model.factory 'x:y' raised ValueError: boom"


def test_other_deaths_are_for_a_replacement():
    assert creation_error(_Err(NODE_LOST)) is None
    assert cause_line(_Err(NODE_LOST)) == "The actor died unexpectedly before finishing this task."
    crash = CREATION_FAILED.replace("classgrad.errors.InputError", "RuntimeError")
    assert creation_error(_Err(crash)) is None  # a bug or a lost GPU may not happen again
    assert cause_line(_Err(crash)).startswith("RuntimeError: model.factory")


def _raised_in_shard(cause: BaseException) -> _Err:
    err = _Err("ray task error")
    err.cause = cause  # what RayTaskError carries: the exception the shard raised
    return err


def test_a_store_still_unreachable_is_retried_as_a_shard_failure_and_other_store_errors_fail_at_once(tmp_path):
    config = JobConfig.model_validate(small_job(str(tmp_path / "s.zarr"), sharding={"max_attempts": 2}))
    driver = JobDriver(config)
    driver._failed = []
    shard = Shard(index=3, start=12, stop=16, work=4.0)
    queue: collections.deque = collections.deque()
    attempts: collections.Counter = collections.Counter()
    down = StoreUnavailableError("cannot write rows [12, 14) to s3://b/x.zarr: still failing after 5 tries in 3.1 s: X")

    driver._shard_raised(shard, _raised_in_shard(down), queue, attempts)
    assert list(queue) == [shard] and driver.summary.retries == 1 and driver._failed == []
    queue.clear()
    driver._shard_raised(shard, _raised_in_shard(down), queue, attempts)  # the last attempt
    assert not queue and driver._failed == [(shard, 2, f"StoreUnavailableError: {down}")]

    for user_error in (StoreError("write_rows: row 3 (class 3) has non-finite values"), LeaseHeldError("lost")):
        with pytest.raises(type(user_error), match=re.escape(str(user_error))):
            driver._shard_raised(shard, _raised_in_shard(user_error), queue, attempts)
