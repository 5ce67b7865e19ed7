"""The dispatcher's promises (``service/driver_runtime/dispatch.py``), on simulated actors and a virtual
clock (``tests/support/simulated_actors.py``): never a hang on a lost node with no spare
capacity, a start with the actors that are up, one line when no actor is left, a memory pause
that does not stop the loop, retries and user errors as before. The same loop on real Ray nodes:
``tests/integration/test_lost_capacity.py``."""

from __future__ import annotations

import collections
import re

import pytest

from classgrad.errors import ClassgradError, InputError, ShardFailedError, StoreUnavailableError
from classgrad.service.driver_runtime.dispatch import DispatchPolicy, ShardDispatcher
from classgrad.service.driver_runtime.plan import Shard, plan_shards
from tests.support.simulated_actors import SimulatedActors, SimulatedShardError, VirtualClock

TIMEOUT_S = 300.0


class Events:
    def __init__(self, on_done=None):
        self.ready: list[tuple[int, int]] = []  # (slot, generation)
        self.done: collections.Counter = collections.Counter()  # shard -> completions
        self.by_slot: collections.Counter = collections.Counter()
        self.ticks = 0
        self.on_done = on_done

    def actor_ready(self, slot, info):
        self.ready.append((slot.index, slot.generation))

    def shard_done(self, slot, shard, report):
        self.done[shard.index] += 1
        self.by_slot[slot.index] += 1
        if self.on_done is not None:
            self.on_done(len(self.done))

    def tick(self):
        self.ticks += 1


def shards(count: int) -> list[Shard]:
    return plan_shards(count * 4, 4, 4)


def make(num_actors: int, capacity: int, *, min_actors: int = 1, max_attempts: int = 3, on_done=None, **sim):
    clock = VirtualClock()
    backend = SimulatedActors(clock, capacity=capacity, **sim)
    events = Events(on_done)
    policy = DispatchPolicy(min_actors=min_actors, max_attempts=max_attempts, start_timeout_s=TIMEOUT_S)
    dispatcher = ShardDispatcher(backend, events, policy, num_actors=num_actors, shards_total=None, clock=clock)
    return dispatcher, backend, events, clock


def test_a_lost_node_with_no_spare_capacity_finishes_on_the_actors_left():
    # One of 4 actors dies with its place (its node) after 10 shards: its replacement never
    # starts. Before, its requeued shards waited for that replacement forever.
    backend_ref = {}

    def lose_a_node(done: int) -> None:
        if done == 10:
            b = backend_ref["b"]
            b.kill([b.live()[0]], lose_places=True)

    dispatcher, backend, events, clock = make(4, 4, on_done=lose_a_node, shard_s=3.0, start_s=5.0)
    backend_ref["b"] = backend
    dispatcher.run(shards(200))
    assert dict(events.done) == {i: 1 for i in range(200)}  # every shard once, none lost
    assert dispatcher.actors_replaced == 1 and dispatcher.retries >= 1
    assert dispatcher.ever_ready == 4  # the replacement never answered ready
    replacement = backend.actors[-1]
    assert not replacement.placed and not replacement.calls  # it was given nothing
    # 3 actors at 3 s a shard: about 200 / 3 x 3 s; nothing waited on the bound.
    assert clock.now < 200 * 3.0 / 3 + 60


def test_the_job_starts_with_the_actors_that_are_up_and_late_ones_join():
    dispatcher, backend, events, clock = make(4, 1, shard_s=1.0)
    joined = {}

    def add_node(done: int) -> None:
        if done == 5 and not joined:
            joined["at"] = clock.now
            backend.add_places(3)

    events.on_done = add_node
    dispatcher.run(shards(100))
    assert dict(events.done) == {i: 1 for i in range(100)}
    assert len(events.ready) == 4 and set(events.by_slot) == {0, 1, 2, 3}  # the late three computed too
    assert dispatcher.started_at == pytest.approx(5.0)  # the first actor's start, not the last's


def test_too_few_actors_for_min_workers_fail_at_the_start_up_bound_in_one_line():
    dispatcher, backend, events, clock = make(4, 3, min_actors=4, shard_s=1.0)
    with pytest.raises(ClassgradError) as err:
        dispatcher.run(shards(1000))
    line = str(err.value)
    assert line.startswith("only 3 of 4 actors needed (cluster.min_workers) started within 300 s")
    assert "\n" not in line and clock.now == pytest.approx(TIMEOUT_S, abs=1.0)
    assert line.endswith("; 0 of 0 shards are saved")
    assert not events.done  # the job waits for min_workers before it hands out a shard


def test_min_workers_ready_before_the_first_shard_goes_out():
    dispatcher, backend, events, clock = make(3, 1, min_actors=2, shard_s=1.0)
    original = backend.wait
    starts = {}

    def wait(calls, timeout_s):  # a second place frees 50 s in
        if clock.now >= 50 and "second" not in starts:
            starts["second"] = clock.now
            backend.add_places(1)
        return original(calls, timeout_s)

    backend.wait = wait
    first_done = []
    events.on_done = lambda n: first_done.append(clock.now) if n == 1 else None
    dispatcher.run(shards(20))
    assert dispatcher.started_at == pytest.approx(55.0, abs=1.5)  # the second actor's ready, not the first's
    assert first_done[0] >= dispatcher.started_at + 1.0 and dict(events.done) == {i: 1 for i in range(20)}


def test_all_actors_lost_with_no_capacity_ends_in_one_line_after_the_bound_keeping_what_is_done():
    backend_ref = {}

    def lose_everything(done: int) -> None:
        if done == 20:
            b = backend_ref["b"]
            b.kill(b.live(), lose_places=True)

    dispatcher, backend, events, clock = make(2, 2, on_done=lose_everything, shard_s=1.0)
    dispatcher._total = 50
    backend_ref["b"] = backend
    with pytest.raises(ClassgradError) as err:
        dispatcher.run(shards(50))
    line = str(err.value)
    assert line.startswith("no actor has been ready for 300 s (run.actor_start_timeout_s; 2 starting, 2 replaced)")
    assert line.endswith(f"{len(events.done)} of 50 shards are saved, rerun to resume") and "\n" not in line
    assert len(events.done) == 20 and set(events.done.values()) == {1}
    lost_at = 20 * 1.0 / 2 + 5.0
    assert clock.now == pytest.approx(lost_at + TIMEOUT_S, abs=5.0)  # the bound, not forever


def test_a_replacement_that_starts_later_takes_the_work_back():
    backend_ref = {}

    def lose_and_regain(done: int) -> None:
        b = backend_ref["b"]
        if done == 4:
            b.kill(b.live(), lose_places=True)

    dispatcher, backend, events, clock = make(1, 1, on_done=lose_and_regain, shard_s=1.0)
    backend_ref["b"] = backend
    original = backend.wait

    def wait(calls, timeout_s):  # the node comes back 100 s after the loss
        if backend.free_places == 0 and not backend.live() and clock.now >= 100 and not backend_ref.get("back"):
            backend_ref["back"] = True
            backend.add_places(1)
        return original(calls, timeout_s)

    backend.wait = wait
    dispatcher.run(shards(10))
    assert dict(events.done) == {i: 1 for i in range(10)} and backend_ref.get("back")


def test_a_kill_for_memory_pauses_the_replacement_without_stopping_the_others():
    backend_ref = {}

    def oom(done: int) -> None:
        if done == 6:
            b = backend_ref["b"]
            b.kill([b.live()[0]], lose_places=False, out_of_memory=True)

    dispatcher, backend, events, clock = make(3, 3, on_done=oom, shard_s=1.0, start_s=0.5)
    backend_ref["b"] = backend
    dispatcher.run(shards(60))
    assert dict(events.done) == {i: 1 for i in range(60)}
    assert dispatcher.oom_kills == 1 and dispatcher.actors_replaced == 1
    replacement = backend.actors[-1]
    assert replacement.generation == 2 and replacement.placed


def test_a_shard_that_raises_is_retried_then_fails_the_run_naming_it_once_the_rest_is_done():
    dispatcher, backend, events, clock = make(2, 2, max_attempts=2, shard_s=1.0)
    backend.fail_shard(3, times=1)
    dispatcher.run(shards(10))
    assert dict(events.done) == {i: 1 for i in range(10)} and dispatcher.retries == 1

    dispatcher, backend, events, clock = make(2, 2, max_attempts=2, shard_s=1.0)
    backend.fail_shard(3, times=5)
    with pytest.raises(
        ShardFailedError,
        match=r"^shard 3 \(rows 12-15\) failed 2 times: injected failure of shard 3; 9 of 9 shards are saved",
    ):
        dispatcher.run(shards(10))
    assert set(events.done) == set(range(10)) - {3}


def _raised_in_shard(cause: BaseException) -> SimulatedShardError:
    err = SimulatedShardError("ray task error")
    err.cause = cause  # what RayTaskError carries: the exception the shard raised
    return err


def test_a_store_still_unreachable_is_retried_as_a_shard_failure_and_other_store_errors_fail_at_once():
    from classgrad.errors import LeaseHeldError, StoreError

    dispatcher, *_ = make(1, 1, max_attempts=2)
    shard = Shard(index=3, start=12, stop=16, work=4.0)
    down = StoreUnavailableError("cannot write rows [12, 14) to s3://b/x.zarr: still failing after 5 tries in 3.1 s: X")
    dispatcher._shard_raised(shard, _raised_in_shard(down))
    assert list(dispatcher.queue) == [shard] and dispatcher.retries == 1 and dispatcher.failed == []
    dispatcher.queue.clear()
    dispatcher._shard_raised(shard, _raised_in_shard(down))  # the last attempt
    assert not dispatcher.queue and dispatcher.failed == [(shard, 2, f"StoreUnavailableError: {down}")]
    for user_error in (StoreError("write_rows: row 3 (class 3) has non-finite values"), LeaseHeldError("lost")):
        with pytest.raises(type(user_error), match=re.escape(str(user_error))):
            dispatcher._shard_raised(shard, _raised_in_shard(user_error))


def test_an_actor_whose_constructor_raised_a_user_error_fails_the_run_at_once():
    from tests.support.ray_errors import creation_failed

    dispatcher, backend, events, clock = make(2, 2)
    original = backend.outcome

    def outcome(call):
        if call.shard is None:
            from classgrad.service.driver_runtime.dispatch import Outcome

            return Outcome.LOST, creation_failed(InputError("model.factory 'x:y' raised ValueError: boom"))
        return original(call)

    backend.outcome = outcome
    with pytest.raises(InputError, match="model.factory 'x:y' raised ValueError: boom"):
        dispatcher.run(shards(4))


def test_min_workers_above_the_actors_of_the_run_means_all_of_them():
    """A job file that asks for 2 run with ``--set cluster.num_workers=1`` (or with one shard
    left): the bound is capped at the actors the run starts, never a refusal."""
    dispatcher, backend, events, clock = make(1, 1, min_actors=2, shard_s=1.0)
    dispatcher.run(shards(3))
    assert dict(events.done) == {0: 1, 1: 1, 2: 1} and dispatcher.min_actors == 1
