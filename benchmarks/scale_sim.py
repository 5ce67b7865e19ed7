"""Scale simulation of the driver's dispatch: 1,000 actors, 1,000,000 classes, 3-s shards.

The real driver (``JobDriver.dispatch``: the ``ShardDispatcher`` loop and the driver's own
handling of each ready actor and report) runs against simulated actors on a virtual clock
(``tests/support/simulated_actors.py``: no Ray, no model, no store). Virtual seconds pass only
while the dispatcher waits, so a run of 62,500 shards that takes 3 minutes on a cluster takes
seconds here, and the driver's own CPU is what is left to measure: its CPU per shard (the
process's CPU during the run less the simulated backend's own), and from it the share of one
core the driver needs at the cluster's rate (1,000 actors / 3 s = 333 shards/s).

Scenarios, each printed as a row:
- ``steady``: every actor up, nothing lost;
- ``lose 10%``: 10% of the actors die at once, a third of the way in, their places with them (no
  spare capacity: their replacements never start): the run must finish on the rest;
- ``lose 10%, spare``: the same, with the places left (replacements start after ``--start-s``);
- ``1-s shards``: 3 times the rate.

Ray's own cost per shard (submitting the call, ``ray.wait``, reading the report) is not
simulated: ``--ray-actors N`` measures it apart, the same driver over ``RayActors`` with N stub
actors on a local Ray (no model, no store: each shard sleeps ``--ray-shard-s``), and adds the
driver's CPU per shard there to the table. The store's requests a second per prefix follow from
the simulated rate and a shard's requests as ``tests/integration/test_s3_requests.py`` counts
them; the time to resume is ``benchmarks/store_metadata.py --sim-latency-ms 20``'s.

    .venv/bin/python -m benchmarks.scale_sim                 # 1,000 actors, 1,000,000 classes, shards of 16 rows
    .venv/bin/python -m benchmarks.scale_sim --quick         # 200 actors, 100,000 classes
    .venv/bin/python -m benchmarks.scale_sim --ray-actors 8  # and the driver over real Ray calls
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from benchmarks.common import print_table, print_targets, write_report
from classgrad.config import JobConfig
from classgrad.service.driver_runtime.driver import JobDriver
from classgrad.service.driver_runtime.plan import plan_shards
from tests.support.jobs import small_job
from tests.support.simulated_actors import SimulatedActors, VirtualClock

OUT = Path(__file__).resolve().parent / "out" / "scale_sim.json"
TARGET_RATE = 333.0  # shards/s: 1,000 actors with 3-s shards
CORE_GOAL = 0.5  # of one core, at the target rate
PREFIX_PUT_LIMIT = 3500.0  # S3's PUTs a second per prefix
# Requests of one sharded shard by prefix, as tests/integration/test_s3_requests.py counts them
# from moto's log (the lease GETs are the lease object's, a prefix of its own).
SHARD_REQUESTS = {
    "grads/": ("PUT", 1),
    "row_scale/": ("PUT", 1),
    "loss/": ("PUT", 1),
    "count/": ("PUT", 1),
    "shard_records/": ("PUT", 1),
    "shard_done/": ("PUT", 1),
    "<store>.classgrad-lease.json": ("GET", 2),
}


def simulate(
    actors: int, classes: int, shard_rows: int, shard_s: float, *, lose: float = 0.0, spare: bool = False, start_s=30.0
) -> dict:
    config = JobConfig.model_validate(
        small_job(
            "unused.zarr",
            loss={"num_classes": classes},
            sharding={"shard_rows": shard_rows},
            store={"row_chunk": shard_rows},
            cluster={"num_workers": actors},
            run={"progress": "none"},
        )
    )
    todo = plan_shards(classes, shard_rows, shard_rows)
    driver = JobDriver(config)
    driver.summary.shards_total = len(todo)
    clock = VirtualClock()
    rng = random.Random(0)
    backend = SimulatedActors(
        clock, capacity=actors, shard_s=lambda s: shard_s * rng.uniform(0.9, 1.1), start_s=start_s
    )
    lost_at: dict[str, float] = {}
    shard_done = driver.shard_done

    def done_and_maybe_lose(slot, shard, report):
        shard_done(slot, shard, report)
        if lose and not lost_at and driver.summary.shards_done >= len(todo) // 3:
            victims = rng.sample(backend.live(), int(actors * lose))
            lost_at["t"] = clock.now
            backend.kill(victims, lose_places=not spare)

    driver.shard_done = done_and_maybe_lose  # the driver's own handling, and the loss beside it
    cpu0 = time.process_time()
    driver.dispatch(backend, todo, clock=clock)
    cpu = time.process_time() - cpu0 - backend.backend_s
    dispatcher = driver._dispatcher
    assert dispatcher is not None
    assert dict(driver.completions) == {s.index: 1 for s in todo}, "a shard was lost or done twice"
    started = dispatcher.started_at or 0.0
    shards = len(todo)
    return {
        "actors": actors,
        "classes": classes,
        "shards": shards,
        "shard_s": shard_s,
        "virtual_s": clock.now,
        "compute_s": clock.now - started,
        "shards_per_s": shards / max(clock.now - started, 1e-9),
        "driver_cpu_s": cpu,
        "driver_cpu_per_shard_ms": 1e3 * cpu / shards,
        "backend_cpu_s": backend.backend_s,
        "lost_actors": int(actors * lose),
        "actors_replaced": dispatcher.actors_replaced,
        "requeued": dispatcher.retries,
        "ideal_s": shards * shard_s / actors,
    }


class StubWorker:
    """An actor with the worker's two calls and nothing behind them (pickled by value from here)."""

    def ready(self) -> dict:
        import os

        return {"node": "stub", "pid": os.getpid()}

    def compute_shard(self, shard: int, attempt: int = 1, seconds: float = 0.0) -> dict:
        time.sleep(seconds)
        return {"shard": shard, "rows": 16, "bytes": 0, "recomputed_rows": 0, "node": "stub", "pid": 0}


def ray_stub(actors: int, shards: int, shard_s: float) -> dict:
    """The driver's CPU per shard over real Ray calls: ``JobDriver.dispatch`` over ``RayActors``
    with stub actors (the process's CPU during the run, Ray's client threads in it included)."""
    import ray

    from classgrad.service.driver_runtime.ray_actors import RayActors

    config = JobConfig.model_validate(
        small_job(
            "unused.zarr",
            loss={"num_classes": shards * 16},
            sharding={"shard_rows": 16},
            store={"row_chunk": 16},
            cluster={"num_workers": actors},
            run={"progress": "none"},
        )
    )
    todo = plan_shards(shards * 16, 16, 16)
    ray.init(num_cpus=max(actors, 2), include_dashboard=False, log_to_driver=False)
    try:
        backend = RayActors(StubWorker, {"num_cpus": 1, "max_restarts": 0}, lambda: ((), {}), "scale-sim")
        backend.compute = lambda actor, shard, attempt: actor.compute_shard.remote(shard.index, attempt, shard_s)
        driver = JobDriver(config)
        driver.summary.shards_total = len(todo)
        cpu0, t0 = time.process_time(), time.perf_counter()
        driver.dispatch(backend, todo)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        assert dict(driver.completions) == {s.index: 1 for s in todo}
        driver._stop_actors()
    finally:
        ray.shutdown()
    return {
        "actors": actors,
        "shards": shards,
        "shard_s": shard_s,
        "wall_s": wall,
        "driver_cpu_s": cpu,
        "driver_cpu_per_shard_ms": 1e3 * cpu / shards,
        "shards_per_s": shards / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actors", type=int, default=1000)
    parser.add_argument("--classes", type=int, default=1_000_000)
    parser.add_argument("--shard-rows", type=int, default=16)
    parser.add_argument("--start-s", type=float, default=30.0, help="virtual seconds an actor takes to start")
    parser.add_argument("--quick", action="store_true", help="200 actors, 100,000 classes")
    parser.add_argument("--ray-actors", type=int, default=0, help="also measure the driver over N stub Ray actors")
    parser.add_argument("--ray-shards", type=int, default=4000)
    parser.add_argument("--ray-shard-s", type=float, default=0.02)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    if args.quick:
        args.actors, args.classes = 200, 100_000
    runs = {
        "steady": simulate(args.actors, args.classes, args.shard_rows, 3.0, start_s=args.start_s),
        "lose 10%": simulate(args.actors, args.classes, args.shard_rows, 3.0, lose=0.1, start_s=args.start_s),
        "lose 10%, spare": simulate(
            args.actors, args.classes, args.shard_rows, 3.0, lose=0.1, spare=True, start_s=args.start_s
        ),
        "1-s shards": simulate(args.actors, args.classes, args.shard_rows, 1.0, start_s=args.start_s),
    }
    print(f"== scale simulation: {args.actors} actors, {args.classes} classes, shards of {args.shard_rows} rows")
    print_table(
        ["scenario", "shards", "virtual s", "ideal s", "shards/s", "driver CPU/shard", "core at 333/s", "replaced"],
        [
            [
                name,
                r["shards"],
                f"{r['virtual_s']:.0f}",
                f"{r['ideal_s'] + args.start_s:.0f}",
                f"{r['shards_per_s']:.0f}",
                f"{r['driver_cpu_per_shard_ms']:.3f} ms",
                f"{r['driver_cpu_per_shard_ms'] * TARGET_RATE / 1e3:.3f}",
                r["actors_replaced"],
            ]
            for name, r in runs.items()
        ],
    )
    ray_run = ray_stub(args.ray_actors, args.ray_shards, args.ray_shard_s) if args.ray_actors else None
    if ray_run is not None:
        print(
            f"\n== the same driver over real Ray calls: {ray_run['actors']} stub actors, {ray_run['shards']} shards "
            f"of {ray_run['shard_s']} s: {ray_run['shards_per_s']:.0f} shards/s, driver CPU "
            f"{ray_run['driver_cpu_per_shard_ms']:.3f} ms/shard"
        )
    ray_ms = ray_run["driver_cpu_per_shard_ms"] if ray_run else 0.0
    worst = max(r["driver_cpu_per_shard_ms"] for r in runs.values()) + ray_ms
    one_s = runs["1-s shards"]
    targets = [
        {
            "name": f"driver core share at {TARGET_RATE:.0f} shards/s" + (" (with Ray's calls)" if ray_run else ""),
            "value": worst * TARGET_RATE / 1e3,
            "goal": f"< {CORE_GOAL}",
            "met": worst * TARGET_RATE / 1e3 < CORE_GOAL,
        },
        {
            "name": "driver core share with 1-s shards",
            "value": (one_s["driver_cpu_per_shard_ms"] + ray_ms) * one_s["shards_per_s"] / 1e3,
            "goal": "< 1 (keeps up)",
            "met": (one_s["driver_cpu_per_shard_ms"] + ray_ms) * one_s["shards_per_s"] / 1e3 < 1,
        },
        {
            "name": "lose 10%, no spare: finishes, time / steady",
            "value": runs["lose 10%"]["virtual_s"] / runs["steady"]["virtual_s"],
            "goal": "finishes, ~1.07 (2/3 of the work on 90%)",
            "met": True,  # simulate() asserted every shard done exactly once
        },
    ]
    rate = runs["1-s shards"]["shards_per_s"]
    per_prefix = {prefix: (method, n * rate) for prefix, (method, n) in SHARD_REQUESTS.items()}
    print(f"\n== requests a second per prefix on S3 at {rate:.0f} shards/s (1-s shards), a sharded store")
    print_table(["prefix", "requests/s"], [[p, f"{r:.0f} {m}"] for p, (m, r) in per_prefix.items()])
    busiest = max(r for m, r in per_prefix.values() if m == "PUT")
    targets.append(
        {
            "name": "PUTs a second on the busiest prefix, 1-s shards",
            "value": busiest,
            "goal": f"< {PREFIX_PUT_LIMIT:.0f}",
            "met": busiest < PREFIX_PUT_LIMIT,
        }
    )
    print_targets(targets, ".3f")
    report = {"args": vars(args), "runs": runs, "ray": ray_run, "requests_per_prefix": per_prefix, "targets": targets}
    write_report(args.out, report)


if __name__ == "__main__":
    main()
