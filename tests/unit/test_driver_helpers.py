"""How the driver reads Ray's failures (Ray's own exceptions, built without a cluster): the one
line it reports, whether an actor died of a user error (fail at once) or of something a
replacement can fix, and whether a shard's error is retried."""

from __future__ import annotations

from classgrad.errors import InputError
from classgrad.service.driver_runtime.actor_deaths import cause_line, creation_error
from tests.support.ray_errors import actor_died, creation_failed

BOOM = "model.factory 'x:y' raised ValueError: boom"
NODE_LOST = "The actor is dead because its node has died. Node Id: abcd"


def test_a_constructor_user_error_is_recognised_and_named():
    died = creation_failed(InputError(BOOM))
    err = creation_error(died)
    assert isinstance(err, InputError)
    assert str(err) == BOOM
    assert cause_line(died) == f"InputError: {BOOM}"


def test_other_deaths_are_for_a_replacement():
    assert creation_error(actor_died(NODE_LOST)) is None
    assert cause_line(actor_died(NODE_LOST)) == "The actor died unexpectedly before finishing this task."
    crash = creation_failed(RuntimeError(BOOM))
    assert creation_error(crash) is None  # a bug or a lost GPU may not happen again
    assert cause_line(crash).startswith("RuntimeError: model.factory")
    # The text of a constructor's failure on an exception that is not Ray's says nothing of its own.
    assert creation_error(RuntimeError(str(creation_failed(InputError(BOOM))))) is None
