"""Hands a run's shards to its actors, and never waits on an actor that is not there.

Holds:
- ``ActorBackend``: the interface to the actors (start one, ask it whether it is ready, give it a
  shard, wait for calls, read a call's outcome). ``ray_actors.RayActors`` is Ray's; the scale
  simulation and the unit tests use simulated actors (``tests/support/simulated_actors.py``).
- ``DispatchEvents``: what the driver hears (an actor ready, a shard done, a tick of the loop).
- ``DispatchPolicy``: the run's bounds, from the job config.
- ``ShardDispatcher``: the loop. Its promises, each a way a run at 1,000 actors hung or failed:
  - a shard goes only to an actor that answered ``ready``: a replacement that never starts (its
    node gone, no spare capacity) holds nothing, and a lost actor's shards go back to the front
    of the queue for the actors that are up;
  - the run starts as soon as ``min_actors`` actors are ready (``cluster.min_workers``, 1 by
    default), and fails at start-up only when fewer are ready after ``start_timeout_s``; later
    actors join when they are ready;
  - while work is left and no actor is ready, the run fails after ``start_timeout_s`` in one
    line that says how many shards are saved (nothing done is lost: each shard is in the store);
  - a replacement after a kill for memory starts after a pause (1, 2, 4 ... s, at most 10 s),
    without stopping the loop: the other actors' reports are read meanwhile;
  - work per event is O(1) in the number of actors (no pass over all slots per report).
"""

from __future__ import annotations

import collections
import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from classgrad.errors import ClassgradError, ShardFailedError
from classgrad.service.driver_runtime.actor_deaths import (
    cause_line,
    creation_error,
    out_of_memory_failure,
    out_of_memory_line,
)
from classgrad.service.driver_runtime.plan import Shard

__all__ = ["ActorBackend", "ActorSlot", "DispatchEvents", "DispatchPolicy", "Outcome", "ShardDispatcher"]

log = logging.getLogger(__name__)

WAIT_S = 1.0  # the longest the loop sleeps without a tick (lease renewal, progress lines, bounds)
OOM_PAUSE_MAX_S = 10.0


class Outcome(enum.Enum):
    DONE = "done"  # the call returned; the value is its result
    LOST = "lost"  # the actor is gone (died, killed, its node lost); the value is the exception
    RAISED = "raised"  # the call raised; the actor lives; the value is the exception


class ActorBackend(Protocol):
    """The actors of one run, as the dispatcher drives them. A call is any hashable handle."""

    def start(self, slot: int, generation: int) -> Any:
        """Create the actor of ``slot``'s ``generation``-th start; returns its handle at once."""

    def ready(self, actor: Any) -> Any:
        """A call that finishes when ``actor`` is built (its value: the actor's ready info)."""

    def compute(self, actor: Any, shard: Shard, attempt: int) -> Any:
        """A call that computes and stores ``shard`` (its value: the shard's report)."""

    def wait(self, calls: Sequence[Any], timeout_s: float) -> list[Any]:
        """The calls of ``calls`` that have finished, waiting at most ``timeout_s`` for one."""

    def outcome(self, call: Any) -> tuple[Outcome, Any]:
        """How a finished call ended, and its value or exception."""


class DispatchEvents(Protocol):
    def actor_ready(self, slot: ActorSlot, info: dict[str, Any]) -> None: ...

    def shard_done(self, slot: ActorSlot, shard: Shard, report: dict[str, Any]) -> None: ...

    def tick(self) -> None: ...


@dataclass(frozen=True)
class DispatchPolicy:
    inflight_per_actor: int = 2  # cluster.inflight_per_worker
    max_attempts: int = 3  # sharding.max_attempts; also bounds replacements (x actors)
    min_actors: int = 1  # cluster.min_workers, capped at the run's actors
    start_timeout_s: float = 300.0  # run.actor_start_timeout_s
    # What each actor asks for and the cluster has, said when actors do not start (Ray is asked then).
    resources: Callable[[], str] = field(default=lambda: "")


@dataclass(eq=False)
class ActorSlot:
    """One actor position: its current actor, whether that one is ready, its shards in flight."""

    index: int
    generation: int = 0  # bumped at each start (replacements)
    actor: Any = None
    ready: bool = False
    start_at: float | None = None  # a replacement waiting out a pause after a kill for memory
    inflight: collections.deque = field(default_factory=collections.deque)  # (call, shard), oldest first


class ShardDispatcher:
    """Runs ``todo`` on ``num_actors`` actors of ``backend`` (module docstring: its promises)."""

    def __init__(
        self,
        backend: ActorBackend,
        events: DispatchEvents,
        policy: DispatchPolicy,
        *,
        num_actors: int,
        shards_saved_before: int = 0,
        shards_total: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.backend = backend
        self.events = events
        self.policy = policy
        self.clock = clock
        self.slots = [ActorSlot(i) for i in range(num_actors)]
        self.min_actors = max(1, min(policy.min_actors, num_actors))
        self.completions: collections.Counter = collections.Counter()  # shard index -> times completed
        self.attempts: collections.Counter = collections.Counter()  # shard index -> failed attempts
        self.failed: list[tuple[Shard, int, str]] = []  # out of attempts: the run fails once the rest is done
        self.retries = 0  # shard attempts beyond the first
        self.actors_replaced = 0
        self.oom_kills = 0
        self.ever_ready = 0  # actor starts that answered ready (replacements included)
        self.started_at: float | None = None  # when ``min_actors`` first were ready (clock)
        self._saved_before = shards_saved_before
        self._total = shards_total
        self.queue: collections.deque[Shard] = collections.deque()
        self._calls: dict[Any, tuple[ActorSlot, Shard | None]] = {}  # None: the slot's ready call
        self._hungry: dict[int, ActorSlot] = {}  # ready slots with room, in the order they got it
        self._ready_count = 0
        self._ready_calls = 0  # entries of ``_calls`` that are ready calls, not shards
        self._none_ready_since = 0.0
        self._paused: list[ActorSlot] = []  # replacements waiting out a memory pause (few)

    # --- the loop ------------------------------------------------------------------------------

    def run(self, todo: Sequence[Shard]) -> None:
        """Compute every shard of ``todo`` (in that order, requeued ones first); returns when each
        is done, raises when the run cannot go on (module docstring)."""
        self.queue.extend(todo)
        t0 = self.clock()
        self._none_ready_since = t0
        for slot in self.slots:
            self._start(slot)
        while self.queue or self._shards_in_flight():
            self._start_due()
            finished = self.backend.wait(list(self._calls), WAIT_S)
            for call in finished:
                entry = self._calls.pop(call, None)
                if entry is not None:  # else: its actor's death was already handled
                    self._finished(call, *entry)
            self._feed()
            self._check_bounds(t0)
            self.events.tick()
        if self.failed:
            shard, tries, why = self.failed[0]
            more = f" ({len(self.failed) - 1} more shards failed too)" if len(self.failed) > 1 else ""
            raise ShardFailedError(
                f"shard {shard.index} (rows {shard.start}-{shard.stop - 1}) failed {tries} times: {why}; "
                f"{self._saved_line()}, rerun to resume{more}"
            )

    def _shards_in_flight(self) -> bool:
        return len(self._calls) > self._ready_calls

    def _finished(self, call: Any, slot: ActorSlot, shard: Shard | None) -> None:
        kind, value = self.backend.outcome(call)
        if shard is None:  # the slot's ready call
            self._ready_calls -= 1
            if kind is Outcome.DONE:
                self._became_ready(slot, value)
            else:
                cause = self._replace(slot, value)
                log.warning("actor %d died while starting (%s); a replacement is starting", slot.index, cause)
            return
        if kind is Outcome.LOST:
            self._actor_lost(slot, value)
            return
        _remove(slot.inflight, call)
        self._make_hungry(slot)
        if kind is Outcome.RAISED:
            self._shard_raised(shard, value)
            return
        self.completions[shard.index] += 1
        self.events.shard_done(slot, shard, value)

    def _feed(self) -> None:
        """Hand queued shards to ready actors with room, the longest waiting first."""
        if self.started_at is None:
            return  # fewer than ``min_actors`` ready yet
        limit = self.policy.inflight_per_actor
        while self.queue and self._hungry:
            slot = next(iter(self._hungry.values()))
            while self.queue and len(slot.inflight) < limit:
                shard = self.queue.popleft()
                call = self.backend.compute(slot.actor, shard, self.attempts[shard.index] + 1)
                slot.inflight.append((call, shard))
                self._calls[call] = (slot, shard)
            if len(slot.inflight) >= limit:
                del self._hungry[slot.index]

    def _make_hungry(self, slot: ActorSlot) -> None:
        if slot.ready and len(slot.inflight) < self.policy.inflight_per_actor:
            self._hungry.setdefault(slot.index, slot)

    # --- actors -----------------------------------------------------------------------------

    def _start(self, slot: ActorSlot) -> None:
        slot.generation += 1
        slot.ready = False
        slot.start_at = None
        slot.actor = self.backend.start(slot.index, slot.generation)
        self._calls[self.backend.ready(slot.actor)] = (slot, None)
        self._ready_calls += 1

    def _start_due(self) -> None:
        if not self._paused:
            return
        now = self.clock()
        for slot in self._paused:
            if slot.start_at is not None and slot.start_at <= now:
                self._start(slot)
        self._paused = [s for s in self._paused if s.start_at is not None]

    def _became_ready(self, slot: ActorSlot, info: dict[str, Any]) -> None:
        slot.ready = True
        self._ready_count += 1
        self.ever_ready += 1
        if self.started_at is None and self.ever_ready >= self.min_actors:
            self.started_at = self.clock()
        self.events.actor_ready(slot, info)
        self._make_hungry(slot)

    def _unready(self, slot: ActorSlot) -> None:
        if slot.ready:
            slot.ready = False
            self._ready_count -= 1
            if self._ready_count == 0:
                self._none_ready_since = self.clock()
        self._hungry.pop(slot.index, None)

    def _actor_lost(self, slot: ActorSlot, exc: Exception) -> None:
        """Requeue everything the lost actor held, at the front (the running shard counts an
        attempt), and start a replacement."""
        lost = list(slot.inflight)
        slot.inflight.clear()
        for call, _ in lost:
            self._calls.pop(call, None)
        cause = self._replace(slot, exc)
        if lost:
            running = lost[0][1]
            self.attempts[running.index] += 1
            if self.attempts[running.index] >= self.policy.max_attempts:
                self.failed.append((running, self.attempts[running.index], f"its actor died: {cause}"))
                lost = lost[1:]
        for _, shard in reversed(lost):
            self.queue.appendleft(shard)
        self.retries += len(lost)
        log.warning("actor %d died (%s); %d shard(s) requeued, a replacement is starting", slot.index, cause, len(lost))

    def _replace(self, slot: ActorSlot, exc: Exception) -> str:
        """A new actor for ``slot`` (now or after a memory pause); returns why the old one died, in
        one line. Every replacement counts against one bound (actors x ``max_attempts``)."""
        self._unready(slot)
        user_error = creation_error(exc)
        if user_error is not None:
            raise user_error  # the actor cannot be built from this config: replacing cannot help
        oom = out_of_memory_line(exc)  # Ray's own text is some 40 lines: never stored or shown
        cause = oom or cause_line(exc)
        self.actors_replaced += 1
        if oom is not None:
            self.oom_kills += 1
        if self.actors_replaced > len(self.slots) * self.policy.max_attempts:
            if oom is not None:
                raise ClassgradError(
                    out_of_memory_failure(self.oom_kills, oom, self._saved(), self._total or self._saved())
                )
            raise ClassgradError(f"actors keep dying ({self.actors_replaced} replaced); last: {cause}")
        if oom is not None:  # memory another process took may come back
            slot.actor = None
            slot.start_at = self.clock() + min(2.0 ** (self.oom_kills - 1), OOM_PAUSE_MAX_S)
            self._paused = [*self._paused, slot]
        else:
            self._start(slot)
        return cause

    # --- shards -----------------------------------------------------------------------------

    def _shard_raised(self, shard: Shard, exc: Exception) -> None:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ClassgradError) and not cause.retryable:
            raise type(cause)(str(cause))  # the user's to fix: retrying cannot help
        self.attempts[shard.index] += 1
        line = cause_line(exc)
        tries, limit = self.attempts[shard.index], self.policy.max_attempts
        where = f"shard {shard.index} (rows {shard.start}-{shard.stop - 1})"
        if tries >= limit:
            self.failed.append((shard, tries, line))
            log.error("%s failed %d times, giving up on it: %s", where, tries, line)
            return
        log.warning("%s failed (attempt %d of %d): %s; retrying", where, tries, limit, line)
        self.retries += 1
        self.queue.append(shard)

    # --- bounds -----------------------------------------------------------------------------

    def _check_bounds(self, t0: float) -> None:
        now = self.clock()
        timeout = self.policy.start_timeout_s
        if self.started_at is None and now - t0 >= timeout:
            raise ClassgradError(
                f"only {self.ever_ready} of {self.min_actors} actors needed (cluster.min_workers) started within "
                f"{timeout:.0f} s{self.policy.resources()}; {self._saved_line()}"
            )
        if self._ready_count == 0 and self.queue and now - self._none_ready_since >= timeout:
            waiting = sum(1 for s in self.slots if s.actor is not None or s.start_at is not None)
            raise ClassgradError(
                f"no actor has been ready for {timeout:.0f} s (run.actor_start_timeout_s; {waiting} starting, "
                f"{self.actors_replaced} replaced){self.policy.resources()}; {self._saved_line()}, rerun to resume"
            )

    def _saved(self) -> int:
        return self._saved_before + len(self.completions)

    def _saved_line(self) -> str:
        total = self._total if self._total is not None else self._saved()
        return f"{self._saved()} of {total} shards are saved"


def _remove(inflight: collections.deque, call: Any) -> None:
    for i, (c, _) in enumerate(inflight):
        if c == call:
            del inflight[i]
            return
