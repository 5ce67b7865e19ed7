"""A stopping driver's ``stop_actors`` (service/driver_runtime/stopping.py): when it returns, the killed
actors can mark nothing done any more. Ray reports an actor dead a few milliseconds before its
process is gone; an actor at ``mark_shard_done`` in that gap made a run's record count fewer
shards than the store held (tests/integration/test_cli_job.py's Ctrl-C test failed in CI)."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from classgrad.service.driver_runtime.stopping import stop_actors


def test_killed_actors_processes_are_gone_when_it_returns(ray_local):
    ray = ray_local

    @ray.remote
    class Worker:
        def pid(self) -> int:
            return os.getpid()

        def work(self, seconds: float) -> bool:
            time.sleep(seconds)
            return True

    actors = [Worker.remote() for _ in range(2)]
    procs = [psutil.Process(pid) for pid in ray.get([a.pid.remote() for a in actors])]
    busy = [actors[0].work.remote(120)]  # one actor with a call in flight, one idle
    # Generous: a loaded 2-core machine; the wait ends as soon as both processes have exited.
    assert stop_actors(actors, busy, procs, wait_s=60) == 0
    assert not any(p.is_running() for p in procs)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(busy[0], timeout=30)
