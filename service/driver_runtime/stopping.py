"""How a running job's driver stops on a signal: SIGINT and SIGTERM alike, like Ctrl-C.

Holds ``install_stop_handlers``, called by ``classgrad run`` before the job starts (and
``restore_handlers``, after it), ``stop_actors`` (how a stopping driver ends its actors before
it counts what they saved), and
``INTERRUPTED_LINE``, the last line the CLI prints after such a stop (``classgrad jobs stop
--wait`` looks for it in the job's logs to tell a driver that stopped from one that was killed).

Who sends what: Ray Jobs (``classgrad jobs stop``, ``ray job stop``) sends the driver
``RAY_JOB_STOP_SIGNAL`` (SIGINT, which ``submit.STOP_ENV`` asks for), then SIGKILL after
``RAY_JOB_STOP_WAIT_TIME_S``; Kubernetes (a deleted RayJob or pod) and ``kill`` send SIGTERM,
then SIGKILL. Either signal raises ``KeyboardInterrupt`` in the driver, which stops its actors,
records the run as interrupted and releases the store's lease (``driver.JobDriver.run``).

Both handlers are installed explicitly, because a process can start with SIGINT ignored (a Ray
head started from a script in the background, ``setsid ray start ... &``: a shell without job
control starts background commands with SIGINT and SIGQUIT ignored, and every process Ray starts
inherits that, the job's driver too) or blocked (Ray blocks SIGINT in the processes it starts;
Ray's job supervisor unblocks it only when ``RAY_JOB_STOP_SIGNAL=SIGINT``): Python then installs
no handler of its own and the signal does nothing, so the driver kept computing until SIGKILL
and left neither a record nor a released lease. Both signals are unblocked here too.

A second signal while the driver is stopping is logged, not raised, so that recording the run
and releasing the lease finish before Ray's SIGKILL; a third one (someone pressing Ctrl-C
again and again) interrupts whatever is left.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Sequence
from typing import Any

import psutil

log = logging.getLogger(__name__)

# Printed by the CLI (cli.py) after a driver stopped on Ctrl-C, SIGINT or SIGTERM.
INTERRUPTED_LINE = "classgrad: interrupted; finished shards are saved, rerun the same command to resume"
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _StopOnSignal:
    def __init__(self) -> None:
        self.received = 0

    def __call__(self, signum: int, frame: Any) -> None:
        self.received += 1
        name = signal.Signals(signum).name
        if self.received == 1:
            log.info("%s received: stopping (the run is recorded and the store's lease released)", name)
            raise KeyboardInterrupt
        if self.received == 2:
            log.warning("%s received again: still stopping (recording the run); once more to quit at once", name)
            return
        raise KeyboardInterrupt


def install_stop_handlers() -> dict[int, Any]:
    """SIGINT and SIGTERM both stop the run as Ctrl-C does, whatever this process inherited;
    returns the handlers they replace (``restore_handlers`` puts them back)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_SIGNALS))
    handler = _StopOnSignal()
    before: dict[int, Any] = {int(sig): signal.getsignal(sig) for sig in _SIGNALS}
    for sig in _SIGNALS:
        signal.signal(sig, handler)
    return before


def restore_handlers(before: dict[int, Any]) -> None:
    """The handlers ``install_stop_handlers`` replaced, back (a process that runs the CLI in
    itself, such as a test or a notebook, keeps its own)."""
    for sig, handler in before.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def stop_actors(actors: Sequence[Any], calls: Sequence[Any], processes: Sequence[psutil.Process], wait_s: float) -> int:
    """Kill ``actors`` and wait, at most ``wait_s`` in all, until none can mark a shard done: Ray
    reports each dead (``calls``, their shards in flight, and a call made after the kill fail),
    and ``processes`` (those of the actors on the driver's own node) have exited, for Ray reports
    a death a few milliseconds before the process is gone. Returns how many calls and processes
    had not ended when the wait ran out."""
    import ray

    deadline = time.monotonic() + wait_s
    for actor in actors:
        ray.kill(actor, no_restart=True)
    ends = [*calls, *(actor.__ray_ready__.remote() for actor in actors)]
    _, pending = ray.wait(ends, num_returns=len(ends), timeout=wait_s)
    _, alive = psutil.wait_procs(processes, timeout=max(0.0, deadline - time.monotonic()))
    return len(pending) + len(alive)
