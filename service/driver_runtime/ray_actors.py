"""A run's actors on Ray: the ``dispatch.ActorBackend`` the driver hands to its dispatcher.

Holds ``RayActors``: starts ``GradientWorker`` actors (named ``classgrad-<run>-w<slot>-<generation>``
so that operators and fault tests find them with ``ray list actors``), makes their ``ready`` and
``compute_shard`` calls, waits for calls, and sorts a finished call into done, actor lost (Ray's
``actor_deaths.ACTOR_LOST`` exceptions) or raised (a ``RayTaskError``: the actor lives on).

Ray's own restarts and retries stay off (``max_restarts=0``, ``max_task_retries=0``): the
dispatcher replaces an actor itself so that a lost actor's shards go to the actors that are up at
once, instead of waiting for a restart that may never be scheduled (DESIGN.md, "Scale").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from classgrad.service.driver_runtime.actor_deaths import actor_lost
from classgrad.service.driver_runtime.dispatch import Outcome
from classgrad.service.driver_runtime.plan import Shard

__all__ = ["RayActors"]


class RayActors:
    def __init__(
        self, actor_cls: Any, options: dict[str, Any], make_args: Callable[[], tuple[tuple, dict]], run_id: str
    ):
        import ray

        self._ray = ray
        self._cls = ray.remote(actor_cls)
        self._options = options
        self._make_args = make_args
        self._run_id = run_id
        self._lost = actor_lost(ray)

    def start(self, slot: int, generation: int) -> Any:
        args, kwargs = self._make_args()
        name = f"classgrad-{self._run_id}-w{slot}-{generation}"
        return self._cls.options(**self._options, name=name).remote(*args, **kwargs)

    def ready(self, actor: Any) -> Any:
        return actor.ready.remote()

    def compute(self, actor: Any, shard: Shard, attempt: int) -> Any:
        return actor.compute_shard.remote(shard.index, attempt)

    def wait(self, calls: Sequence[Any], timeout_s: float) -> list[Any]:
        if not calls:  # every actor waits out a pause before its start
            time.sleep(timeout_s)
            return []
        done, rest = self._ray.wait(list(calls), num_returns=1, timeout=timeout_s, fetch_local=False)
        if done and rest:  # every other call finished by now, in one more look (a busy run's reports)
            more, _ = self._ray.wait(rest, num_returns=len(rest), timeout=0, fetch_local=False)
            done.extend(more)
        return done

    def outcome(self, call: Any) -> tuple[Outcome, Any]:
        try:
            return Outcome.DONE, self._ray.get(call)
        except self._lost as exc:
            return Outcome.LOST, exc
        except self._ray.exceptions.RayTaskError as exc:
            return Outcome.RAISED, exc
