"""Seconds to start a local Ray and one actor process until it answers a call (its imports
included, engine build excluded): the measurement behind ``RAY_STARTUP_ALLOWANCE_S`` in
``classgrad.service.driver_runtime.estimate``.

Run: ``python -m benchmarks.ray_startup [--repeats N]`` (each repeat starts and stops its own Ray).
"""

from __future__ import annotations

import argparse
import time


def measure_once() -> float:
    import ray

    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(num_cpus=1)
        class Probe:
            def __init__(self) -> None:
                import classgrad.workers.actor_runtime.actor  # noqa: F401  (what an actor imports)

            def ready(self) -> bool:
                return True

        ray.get(Probe.remote().ready.remote())
        return time.perf_counter() - t0
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times = [measure_once() for _ in range(args.repeats)]
    print("Ray + one actor ready: " + ", ".join(f"{t:.1f} s" for t in times))


if __name__ == "__main__":
    main()
