"""How the driver reads Ray's failure texts: the one line it reports, whether an actor died
of a user error (fail at once) or of something a replacement can fix, and whether a shard's
error is retried."""

from __future__ import annotations

from classgrad.errors import InputError
from classgrad.service.runtime.actor_deaths import cause_line, creation_error

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
