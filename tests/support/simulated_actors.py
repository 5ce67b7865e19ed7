"""Simulated actors on a virtual clock: a ``dispatch.ActorBackend`` with no Ray and no model.

Holds ``VirtualClock`` (seconds that pass only when the backend waits) and ``SimulatedActors``:
a cluster of ``capacity`` actor places. A started actor takes a free place and is ready
``start_s`` later; with no place free it waits, as Ray keeps an actor pending that no node can
hold. Each actor computes its shards one after another, ``shard_s`` each (``shard_s`` may be a
function of the shard). Faults: ``kill`` (actors die; with ``lose_places`` their places go
with them, as when a node is lost and nothing replaces it), ``add_places`` (a node joins),
``fail_shard`` (a shard raises on its next attempts).

The unit tests of ``ShardDispatcher`` and the scale simulation (``benchmarks/scale_sim.py``) use
it. ``wait`` takes finished calls from a heap, so the backend's own cost stays small beside the
dispatcher's at 1,000 actors; ``backend_s`` counts the CPU time spent inside it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from classgrad.service.driver_runtime.dispatch import Outcome
from classgrad.service.driver_runtime.plan import Shard

# The text of a lost actor's exception, as Ray words a node's death.
NODE_LOST = "The actor died unexpectedly before finishing this task.\nThe actor is dead because its node has died."
OOM_KILLED = "Task was killed due to memory pressure (node 10.0.0.1 ran low on memory)."


class SimulatedActorLost(Exception):
    pass


class SimulatedShardError(RuntimeError):
    pass


class VirtualClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)
class SimCall:
    actor: SimActor
    shard: Shard | None  # None: the ready call
    finish_at: float = math.inf
    error: Exception | None = None
    lost: bool = False


@dataclass(eq=False)
class SimActor:
    slot: int
    generation: int
    placed: bool = False
    dead: bool = False
    busy_until: float = 0.0
    ready_call: SimCall | None = None
    calls: list[SimCall] = field(default_factory=list)


class SimulatedActors:
    def __init__(
        self,
        clock: VirtualClock,
        *,
        capacity: int,
        shard_s: float | Callable[[Shard], float] = 3.0,
        start_s: float = 5.0,
    ):
        self.clock = clock
        self.free_places = capacity
        self.shard_s = shard_s
        self.start_s = start_s
        self.actors: list[SimActor] = []  # every actor started, in order
        self.pending: list[SimActor] = []  # started, waiting for a place
        self.failing: dict[int, int] = {}  # shard index -> attempts left to fail
        self.backend_s = 0.0  # CPU seconds spent inside this backend
        self._heap: list[tuple[float, int, SimCall]] = []
        self._seq = itertools.count()

    # --- ActorBackend ----------------------------------------------------------------------------

    def start(self, slot: int, generation: int) -> SimActor:
        t0 = time.process_time()
        actor = SimActor(slot, generation)
        actor.ready_call = SimCall(actor, None)
        self.actors.append(actor)
        self.pending.append(actor)
        self._place_pending()
        self.backend_s += time.process_time() - t0
        return actor

    def ready(self, actor: SimActor) -> SimCall:
        assert actor.ready_call is not None
        return actor.ready_call

    def compute(self, actor: SimActor, shard: Shard, attempt: int) -> SimCall:
        t0 = time.process_time()
        call = SimCall(actor, shard)
        if actor.dead:
            self._lose(call)
        else:
            seconds = self.shard_s(shard) if callable(self.shard_s) else self.shard_s
            actor.busy_until = max(actor.busy_until, self.clock.now) + seconds
            if self.failing.get(shard.index, 0) > 0:
                self.failing[shard.index] -= 1
                call.error = SimulatedShardError(f"injected failure of shard {shard.index}")
            actor.calls.append(call)
            self._finish_at(call, actor.busy_until)
        self.backend_s += time.process_time() - t0
        return call

    def wait(self, calls: Sequence[Any], timeout_s: float) -> list[SimCall]:
        t0 = time.process_time()
        until = self.clock.now + timeout_s
        done: list[SimCall] = []
        while self._heap and self._heap[0][0] <= until:
            at, _, call = heapq.heappop(self._heap)
            if at != call.finish_at:
                continue  # rescheduled (its actor was lost first)
            if not done:
                self.clock.now = max(self.clock.now, at)
                until = self.clock.now  # everything finished by then, in one look
            done.append(call)
        if not done:
            self.clock.now = until
        self.backend_s += time.process_time() - t0
        return done

    def outcome(self, call: SimCall) -> tuple[Outcome, Any]:
        if call.lost:
            return Outcome.LOST, SimulatedActorLost(NODE_LOST if call.error is None else str(call.error))
        if call.error is not None:
            return Outcome.RAISED, call.error
        if call.shard is None:
            return Outcome.DONE, {"node": f"node-{call.actor.slot % 100}", "pid": 0}
        rows = call.shard.rows
        return Outcome.DONE, {"rows": rows, "bytes": rows * 4, "recomputed_rows": 0, "node": "sim", "pid": 0}

    # --- faults ----------------------------------------------------------------------------

    def live(self) -> list[SimActor]:
        return [a for a in self.actors if not a.dead and a.placed]

    def kill(self, actors: Sequence[SimActor], *, lose_places: bool, out_of_memory: bool = False) -> None:
        """``actors`` die now; their calls end as lost. Their places free up for pending actors,
        unless ``lose_places`` (their node is gone)."""
        for actor in actors:
            if actor.dead:
                continue
            actor.dead = True
            for call in [actor.ready_call, *actor.calls]:
                if call is not None and call.finish_at > self.clock.now:  # not finished before the death
                    if out_of_memory:
                        call.error = SimulatedActorLost(OOM_KILLED)
                    self._lose(call)
            if actor in self.pending:
                self.pending.remove(actor)
            elif actor.placed and not lose_places:
                self.free_places += 1
        self._place_pending()

    def add_places(self, count: int) -> None:
        self.free_places += count
        self._place_pending()

    def fail_shard(self, index: int, times: int) -> None:
        self.failing[index] = times

    # --- inside ------------------------------------------------------------------------------

    def _place_pending(self) -> None:
        while self.pending and self.free_places > 0:
            actor = self.pending.pop(0)
            self.free_places -= 1
            actor.placed = True
            actor.busy_until = self.clock.now + self.start_s
            assert actor.ready_call is not None
            self._finish_at(actor.ready_call, actor.busy_until)

    def _lose(self, call: SimCall) -> None:
        call.lost = True
        self._finish_at(call, self.clock.now)

    def _finish_at(self, call: SimCall, at: float) -> None:
        call.finish_at = at
        heapq.heappush(self._heap, (at, next(self._seq), call))
