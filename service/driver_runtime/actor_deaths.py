"""Why a job's actor died, in one line, and whether the node ran out of memory.

Holds:
- ``ACTOR_LOST``: the names of the Ray exceptions that mean "the actor is gone, its shards
  must be requeued" (``RayActorError`` and ``OutOfMemoryError``: Ray fails the tasks of an actor
  that its memory monitor killed with ``OutOfMemoryError``, which is not a ``RayActorError``);
  ``actor_lost(ray)`` gives them as a tuple of classes for ``except``.
- ``is_out_of_memory``: whether a death is Ray's memory monitor (or the kernel's OOM killer)
  killing the actor: Ray's ``OutOfMemoryError``, or the text of the ``ActorDiedError`` that
  later calls see (the only place Ray puts that cause).
- ``out_of_memory_line``: for an actor killed by Ray's memory monitor (or by the kernel's OOM
  killer, as Ray reports it), one line such as ``out of memory: Ray's memory monitor killed the
  actor (node 10.0.0.3: 29.80 GiB used of 31.30 GiB, 95%)``, Ray's figures (which it computes
  in GiB and labels "GB"); None for any other death. Ray's own
  message is some 40 lines (the policy, the top 10 memory users, how to tune the monitor):
  never stored in a run record nor printed by ``status``.
- ``out_of_memory_failure``: the one line a job fails with when memory stays short after its
  bounded replacements.
- ``cause_line``: the one line that says why a Ray task or actor failed (the last line of the
  traceback Ray wraps), and ``creation_error``: the user error an actor's constructor raised
  (a ``RayActorError`` whose ``actor_init_failed`` is set), as the same ``ClassgradError`` type,
  or None for any other death.
"""

from __future__ import annotations

import re
from typing import Any

from classgrad import errors
from classgrad.errors import ClassgradError, first_line

ACTOR_LOST = ("RayActorError", "OutOfMemoryError")

# Ray 2.60's memory monitor: "Memory on the node (IP: 10.0.0.3, ID: 5f..) was 29.80GB used /
# 31.30GB limit (0.952...)". Older Rays: "... where the task (...) was running was 29.80GB / 31.30GB
# (0.952...), which exceeds the memory usage threshold of 0.95".
_NODE_MEMORY = re.compile(
    r"Memory on the node \(IP: (?P<ip>[^,)]+)[^)]*\).*? was (?P<used>[0-9.]+)\s*GB(?: used)?\s*/\s*"
    r"(?P<total>[0-9.]+)\s*GB(?: limit)?\s*\((?P<fraction>[0-9.]+)"
)
_OOM_MARKERS = (
    "running low on memory",
    "NODE_OUT_OF_MEMORY",
    "killed due to memory pressure",
)


def actor_lost(ray: Any) -> tuple[type[Exception], ...]:
    """The Ray exception classes of ``ACTOR_LOST`` (Ray imported by the caller)."""
    return tuple(getattr(ray.exceptions, name) for name in ACTOR_LOST if hasattr(ray.exceptions, name))


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says that the actor was killed because its node ran low on memory.

    The tasks running when Ray's memory monitor kills an actor fail with Ray's ``OutOfMemoryError``;
    every later call on that actor fails with an ``ActorDiedError``, which Ray builds from the
    actor's death context but keeps only as text (the worker's exit type, ``NODE_OUT_OF_MEMORY``,
    and its detail are lines of the message; the exception has no attribute for them). For that
    one the text is the only signal: the phrases in ``_OOM_MARKERS``.
    """
    from ray.exceptions import OutOfMemoryError

    if isinstance(exc, OutOfMemoryError):
        return True
    text = str(exc)
    return any(marker in text for marker in _OOM_MARKERS)


def out_of_memory_line(exc: BaseException) -> str | None:
    """One line for an actor that Ray killed because its node ran low on memory, else None."""
    if not is_out_of_memory(exc):
        return None
    match = _NODE_MEMORY.search(str(exc))
    if match is None:
        return "out of memory: Ray's memory monitor killed the actor (its node ran low on memory)"
    fraction = float(match["fraction"])
    return (
        f"out of memory: Ray's memory monitor killed the actor (node {match['ip'].strip()}: "
        f"{float(match['used']):.2f} GiB used of {float(match['total']):.2f} GiB, {fraction:.0%})"
    )


def out_of_memory_failure(kills: int, last: str, saved: int, total: int) -> str:
    """The job's one line when its actors keep being killed for memory."""
    return (
        f"{last}; memory stayed short: Ray killed {kills} actors of this job for memory, so it stops "
        f"({saved} of {total} shards are saved). Free memory on the nodes, or give each actor more "
        f"of a node (fewer cluster.num_workers, more cluster.num_cpus_per_worker, smaller "
        f"engine.block_rows), and rerun to resume"
    )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# The last line of a Python traceback: "package.module.SomeError: message".
_EXCEPTION_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))(?::\s*(?P<msg>.*))?$")


def _exception_line(text: str) -> re.Match | None:
    for line in reversed(_ANSI.sub("", text).splitlines()):
        match = _EXCEPTION_LINE.match(line.strip())
        if match:
            return match
    return None


def cause_line(exc: BaseException) -> str:
    """The one line that says why a Ray task or actor failed."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        return first_line(cause, with_type=True)
    match = _exception_line(str(exc))
    if match:
        return f"{match['type'].rsplit('.', 1)[-1]}: {match['msg'] or ''}".strip()[:300]
    return first_line(_ANSI.sub("", str(exc))) or type(exc).__name__


def creation_error(exc: BaseException) -> ClassgradError | None:
    """The user error an actor's constructor raised (a bad factory on a worker node, say), or
    None when it died for another reason (node lost, killed, out of memory)."""
    from ray.exceptions import RayActorError

    if not (isinstance(exc, RayActorError) and exc.actor_init_failed):
        return None
    match = _exception_line(str(exc))
    if not match or not match["type"].startswith("classgrad.errors."):
        return None
    kind = getattr(errors, match["type"].rsplit(".", 1)[-1], ClassgradError)
    if not (isinstance(kind, type) and issubclass(kind, ClassgradError)):
        kind = ClassgradError
    return kind(match["msg"] or "an actor failed to start")
