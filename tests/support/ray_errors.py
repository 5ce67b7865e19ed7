"""Ray's own exceptions for a lost actor, built the way Ray builds them, with no cluster.

Holds ``creation_failed`` (the ``ActorDiedError`` of an actor whose constructor raised, as Ray
2.60 makes it from the ``RayTaskError`` of its creation task) and ``actor_died`` (an actor that
died for another reason, with the line Ray's death context gives).
"""

from __future__ import annotations

import traceback

from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError, RayTaskError


def creation_failed(error: Exception) -> ActorDiedError:
    """The death of a ``GradientWorker`` whose ``__init__`` raised ``error``."""
    try:
        raise error
    except Exception as exc:
        trace = "".join(traceback.format_exception(exc))
    task_error = RayTaskError(
        "GradientWorker.__init__",
        trace,
        error,
        proctitle="ray::GradientWorker.__init__",
        pid=28203,
        ip="192.0.2.2",
        actor_repr="<classgrad.workers.actor_runtime.actor.GradientWorker object>",
        actor_id="9e7b",
    )
    return ActorDiedError(task_error)


def actor_died(why: str) -> ActorDiedError:
    """The death of a ``GradientWorker`` for a system reason; ``why`` is Ray's line for it."""
    context = ActorDiedErrorContext(class_name="GradientWorker", actor_id=bytes(16), pid=12, error_message=why)
    return ActorDiedError(context)
