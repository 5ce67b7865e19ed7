"""Soak: 20,000 classes on 2 actors while one actor is killed every few seconds.

The job (an MLP with 20,000 outputs; rows are the gradients of its first layer, 72 numbers, so
the store stays small: 20,000 x 72 float32) runs in this process on the module's local Ray
(``ray_local``, 2 CPUs). A killer thread ``ray.kill``s the current actor of one slot, then of
the other, whatever it is doing (starting, computing, writing a chunk, marking a shard done):
every ``KILL_EVERY_SHARDS`` completed shards, at least ``MIN_GAP_S`` apart, ``MAX_KILLS``
times. The kill clock is the job's own progress, so a fast machine gets as many kills as a
slow one (here: one every 2-6 s). The job must:

- keep making progress: a shard it had not completed before completes at least every
  ``STALL_S`` while it runs, from its start to its end (a liveness bound on progress, not on
  total time: a lost shard or a stuck queue would hang it, a loaded machine only slows it; speed
  is not a goal here, benchmarks measure it). ``SAFETY_NET_S`` on the whole job is only a net
  for one that keeps completing new shards too slowly to wait on, far above what a slow machine
  needs;
- complete every shard exactly once as far as the driver is concerned (``driver.completions``:
  each of the 80 shards once), with every row readable (the reader refuses rows of shards not
  marked done, and done rows that were never written);
- match an uninterrupted run bit for bit (``harness.uninterrupted``: the same worker code in
  this process, one torch thread like an actor): rows, losses and counts;
- report what it survived: every kill (but perhaps the last, if it hit an actor with no shard
  left) as a replaced actor, and the requeued shards as retries.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from classgrad.config import JobConfig
from classgrad.service.driver_runtime.driver import JobDriver
from classgrad.store import open_store
from tests.support.harness import (
    assert_identical,
    store_arrays,
    uninterrupted,
)
from tests.support.jobs import small_job

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

C = 20_000
SHARD_ROWS = 250  # 80 shards of ~0.1 s each on one core
KILL_EVERY_SHARDS = 8  # kills once 2, 10, ... 58 shards are done: spread over the whole job,
FIRST_KILL_AT = 2  # with 22 shards left after the last for it to land and be noticed
# Kills of one slot are at least two gaps apart; a replacement actor starts within one here. At
# 1 s, a job whose replacements start quickly could end before the eighth kill (seen in CI).
MIN_GAP_S = 0.5
MAX_KILLS = 8
# Liveness is bounded by progress, not by total time (issue 47: a fixed 120 s for the whole job
# was missed on a loaded machine; a slow job is not a hung one). The test fails when, while the
# job still runs, STALL_S pass without the driver counting a shard it had not completed before:
# a lost shard, a stuck queue or a driver that stopped reading reports all stop that count for
# good. Distinct shards, not completions: a shard completed again (a bug of its own, asserted
# below) is no progress, so a job that never ends stalls too, after at most 80 steps.
# The longest quiet spans of a healthy run are its start and both slots' actors being replaced
# at once (every second kill: 8 shards take less than a replacement's start); each is Ray
# starting worker processes that import torch, which CPU contention slows far more than the
# shards. The ``longest_stall_s`` property records it: 2 s on an idle 2-core machine, 43 s with
# 2 busy loops beside the test, 100 s with 4 (load average 10). 300 s is 3 times the worst of
# those, the time the driver itself gives actors to start (``run.actor_start_timeout_s``'s
# default), and still a failure within minutes of a hang.
STALL_S = 300.0
# Only a safety net on the whole job (the liveness bound is STALL_S): a job that keeps completing
# new shards but too slowly for anyone to wait on. The job takes 13 s on an idle 2-core machine,
# 205 s with 2 busy loops beside it and 471 s with 4; 1800 s (15 times the old 120-s bound) is
# far above that. The test's pytest timeout sits above it plus the uninterrupted run (~30 s with
# 4 busy loops), so this net, not that timeout, reports such a job.
SAFETY_NET_S = 1800.0


def soak_job(url: str) -> dict:
    return small_job(
        url,
        model={"factory": "classgrad.workers.zoo:mlp", "kwargs": {"num_classes": C, "in_features": 8, "hidden": 8}},
        data={
            "kwargs": {"num_classes": C, "samples_per_class": 1, "kind": "vector", "input_shape": [8], "seed": 3},
            "batch_size": 256,
        },
        loss={"num_classes": C},
        params={"include": ["0.*"]},
        # Kills land on running shards: each such shard counts an attempt, and each kill costs a
        # replacement (the driver allows num_workers x max_attempts of those).
        sharding={"shard_rows": SHARD_ROWS, "max_attempts": MAX_KILLS + 2},
        store={"row_chunk": 50},
        run={"progress": "none"},
    )


def _current_actor(ray, run_id: str, slot: int):
    """The newest actor of a slot of the run, by its name ``classgrad-<run>-w<slot>-<generation>``."""
    prefix = f"classgrad-{run_id}-w{slot}-"
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    if not named:
        return None, None
    newest = max(named, key=lambda a: int(a["name"][len(prefix) :]))
    return newest["name"], ray.get_actor(newest["name"], namespace=newest["namespace"])


def _killer(driver: JobDriver, ray, stop: threading.Event, kills: list[tuple[str, float]]) -> None:
    """Kill the current actor of slot 0, then of slot 1, and so on, once per KILL_EVERY_SHARDS
    completed shards. Not before the first shards: an actor that dies before all of the job's
    first actors are ready is taken for a failed start and fails the job (see
    JobDriver._wait_ready), a gap of its own, not what this test soaks."""
    next_at, last = FIRST_KILL_AT, 0.0
    while not stop.wait(0.1) and len(kills) < MAX_KILLS:
        if driver.summary.shards_done < next_at or time.monotonic() - last < MIN_GAP_S:
            continue
        try:
            name, actor = _current_actor(ray, driver.run_id, len(kills) % 2)
            if actor is None:
                continue  # its replacement is not created yet
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - the job may be ending; a missed kill is not counted
            continue
        last = time.monotonic()
        kills.append((name, last))
        next_at += KILL_EVERY_SHARDS


def _wait_while_progressing(job: threading.Thread, driver: JobDriver, t0: float) -> float:
    """Wait for the job thread to end. Fail if it is still running STALL_S after the last new
    shard completed (or after its start, before the first), or SAFETY_NET_S after its start.
    Returns the longest span it ran without a new shard (polled every 0.5 s), start and end
    included."""
    seen, last, longest = 0, t0, 0.0
    while True:
        job.join(timeout=0.5)
        now = time.monotonic()
        done = len(driver.completions)  # distinct shards; len() of a dict is atomic
        if done != seen:
            seen, last = done, now
        longest = max(longest, now - last)
        if not job.is_alive():
            return longest
        where = (
            f"{seen} of {driver.summary.shards_total} shards completed, {driver.summary.actors_replaced} actors "
            f"replaced, {driver.summary.retries} retries, {now - t0:.0f} s since the start"
        )
        assert now - last <= STALL_S, (
            f"the soak job made no progress for {now - last:.0f} s (liveness bound: a new shard completed "
            f"at least every {STALL_S:.0f} s) and is still running: {where}"
        )
        assert now - t0 <= SAFETY_NET_S, (
            f"the soak job is still running after {SAFETY_NET_S:.0f} s, the SAFETY NET on its total time "
            f"(not the liveness bound, which is progress: it still completes new shards): {where}"
        )


@pytest.mark.timeout(SAFETY_NET_S + 300)  # above the safety net plus the uninterrupted run
def test_20000_classes_survive_an_actor_killed_every_few_seconds(tmp_path, ray_local, record_property):
    url = str(tmp_path / "soak.zarr")
    config = JobConfig.model_validate(soak_job(url))
    driver = JobDriver(config)
    outcome: dict = {}
    kills: list[tuple[str, float]] = []  # (actor name, when)
    stop = threading.Event()

    def run() -> None:
        try:
            outcome["summary"] = driver.run()
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    # A daemon: a hung driver left behind by a failed test must not keep pytest from exiting.
    job = threading.Thread(target=run, name="soak-driver", daemon=True)
    killer = threading.Thread(target=_killer, args=(driver, ray_local, stop, kills), name="soak-killer")
    t0 = time.monotonic()
    job.start()
    killer.start()
    try:
        longest_stall = _wait_while_progressing(job, driver, t0)
    finally:
        stop.set()
        killer.join(timeout=30)
    seconds = time.monotonic() - t0
    assert "error" not in outcome, f"{outcome.get('error')!r} after {len(kills)} kills"
    summary = outcome["summary"]
    # The figures, for --junitxml (CI keeps them): what the job survived, and how long it took.
    gaps = np.diff([t0] + [at for _, at in kills])
    for name, value in (
        ("kills", len(kills)),
        ("actors_replaced", summary.actors_replaced),
        ("retries", summary.retries),
        ("seconds", round(seconds, 1)),
        ("longest_stall_s", round(longest_stall, 1)),
        ("seconds_between_kills", round(float(gaps[1:].mean()), 1) if len(gaps) > 1 else None),
    ):
        record_property(name, value)
    assert summary.status == "complete"
    assert len(kills) == MAX_KILLS, f"only {len(kills)} kills: {kills}"
    # Every kill hit a live actor of this run, which the driver replaced when it noticed: when
    # its next shard failed. A kill in the job's last seconds may hit an actor with no shard
    # left, which nothing notices (and nothing needs to).
    assert len(kills) - 1 <= summary.actors_replaced <= len(kills) and summary.retries >= 1, (summary, kills)
    num_shards = -(-C // SHARD_ROWS)
    assert dict(driver.completions) == {i: 1 for i in range(num_shards)}
    store = open_store(url)
    assert store.is_complete and store.runs[-1]["actors_replaced"] == summary.actors_replaced
    got = store_arrays(url)
    assert np.isfinite(got["rows"]).all() and (got["count"] == 1).all()

    clean = JobConfig.model_validate(soak_job(str(tmp_path / "clean.zarr")))
    assert_identical(got, uninterrupted(clean))
