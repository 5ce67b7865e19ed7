"""A slice of the test suite, quiet and under load, by torch's thread setting (issue 57, item 5).

Runs ``--tests`` (pytest, one process) once per setting, quiet, then again with ``--load`` busy
processes (``while True: pass``, CPU-bound, as other sessions' work is) running beside it, and
prints the seconds of each run. The settings:

- ``two threads``: ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` set to the number of cores;
- ``passive``: the same, with ``OMP_WAIT_POLICY=PASSIVE`` (a waiting thread sleeps, never spins);
- ``one thread``: ``OMP_NUM_THREADS=MKL_NUM_THREADS=1``, the setting ``tests/conftest.py`` uses.

A run past ``--limit`` seconds is stopped and printed as ``> limit``. Prints times; asserts
nothing. Run it on a machine with nothing else running: the load is the one it makes.

    .venv/bin/python -m benchmarks.suite_under_load                  # load 10, the default slice
    .venv/bin/python -m benchmarks.suite_under_load --load 0         # quiet only
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import print_table

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TESTS = ["tests/unit/test_tensor_sketch.py", "tests/unit/test_kronecker.py"]
BUSY = "while True: pass"


def settings() -> dict[str, dict[str, str]]:
    cores = str(os.cpu_count() or 1)
    two = {"OMP_NUM_THREADS": cores, "MKL_NUM_THREADS": cores}
    return {
        "two threads": two,
        "passive": {**two, "OMP_WAIT_POLICY": "PASSIVE"},
        "one thread": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    }


def timed_run(tests: list[str], env: dict[str, str], limit: float) -> str:
    """Seconds of one pytest run of ``tests`` with ``env`` added, or ``> limit``."""
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *tests],
            cwd=REPO,
            env={**os.environ, **env},
            capture_output=True,
            timeout=limit,
        )
    except subprocess.TimeoutExpired:
        return f"> {limit:.0f}"
    seconds = time.perf_counter() - start
    return f"{seconds:.1f}" if done.returncode == 0 else f"{seconds:.1f} (failed)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", nargs="+", default=DEFAULT_TESTS)
    parser.add_argument("--load", type=int, default=10, help="busy processes beside the loaded runs")
    parser.add_argument("--limit", type=float, default=400.0, help="seconds before a run is stopped")
    args = parser.parse_args()
    rows = {name: [name, timed_run(args.tests, env, args.limit)] for name, env in settings().items()}
    if args.load:
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.load)]
        try:
            time.sleep(30)  # the load average up to the load
            for name, env in settings().items():
                rows[name] += [timed_run(args.tests, env, args.limit), f"{os.getloadavg()[0]:.1f}"]
        finally:
            for proc in busy:
                proc.kill()
    headers = ["setting", "quiet (s)"] + ([f"load {args.load} (s)", "load average after"] if args.load else [])
    print_table(headers, list(rows.values()))


if __name__ == "__main__":
    main()
