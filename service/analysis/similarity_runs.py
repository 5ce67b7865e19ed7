"""The executors of ``classgrad similarity``'s tasks: on Ray, or one after another in this process.

Holds ``run_ray`` (every task as a Ray task of ``config.num_cpus`` CPUs, each report handed on
as it comes, the lease renewed while they run; the first failure stops the rest and is raised
in one line: a user error as itself, a bug as ``RuntimeError``, a lost task with what to lower)
and ``run_local``. A task is ``task_fn(url, options, plan, a, b, run_id, *rest)``: the dense
strips' and the top-k tiles' alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from classgrad.errors import ClassgradError, first_line


def _task_failed(exc: BaseException, a: int, b: int) -> BaseException:
    """The error to raise for a failed task: a user error as itself, a bug as RuntimeError."""
    import ray

    cause = getattr(exc, "cause", None)
    if isinstance(cause, ClassgradError):
        return cause
    if isinstance(exc, ray.exceptions.RayTaskError):
        detail = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
        return RuntimeError(f"similarity task for rows [{a}, {b}) failed: {first_line(detail)}")
    return ClassgradError(
        f"similarity task for rows [{a}, {b}) was lost ({type(exc).__name__}: "
        f"{first_line(str(exc))}); if it ran out of memory, lower --block-rows or --block-mb (dense) or --task-mb"
    )


def run_ray(
    ray: Any,
    task_fn: Callable[..., dict],
    args: tuple,
    tasks: list[tuple],
    config: Any,
    renew: Callable[[], None],
    done: Callable[[dict], None],
) -> None:
    """Every task on Ray: ``task_fn(url, options, plan, a, b, run_id, *rest)`` for each
    ``(a, b, *rest)`` of ``tasks``; each report goes to ``done`` as it comes."""
    url, options, plan_dict, run_id = args
    task = ray.remote(task_fn).options(num_cpus=config.num_cpus, max_retries=1, name="classgrad-similarity")
    pending = {task.remote(url, options, plan_dict, a, b, run_id, *rest): (a, b) for a, b, *rest in tasks}
    every = max(1.0, min(10.0, config.lease_ttl_s / 4))
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=every)
            renew()
            for ref in ready:
                a, b = pending.pop(ref)
                try:
                    done(ray.get(ref))
                except ray.exceptions.RayError as exc:
                    raise _task_failed(exc, a, b) from None
    finally:
        if pending:  # failed or interrupted: stop the rest, and collect what already ended so
            for ref in pending:  # that Ray does not log their errors as unhandled
                ray.cancel(ref)
            ended, _ = ray.wait(list(pending), num_returns=len(pending), timeout=2.0)
            for ref in ended:
                try:
                    ray.get(ref, timeout=0)
                except Exception:  # noqa: BLE001 - the first failure is what is reported
                    pass


def run_local(
    task_fn: Callable[..., dict],
    args: tuple,
    tasks: list[tuple],
    renew: Callable[[], None],
    done: Callable[[dict], None],
) -> None:
    url, options, plan_dict, run_id = args
    for a, b, *rest in tasks:
        done(task_fn(url, options, plan_dict, a, b, run_id, *rest))
        renew()
