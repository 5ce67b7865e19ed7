"""A ``classgrad score`` run slow enough to be killed part-way, for the resume test
(``tests/integration/test_score_ray.py``): ``python -m tests.support.score_kill STORE QUERIES.npy OUT``
scores the query rows against the store into ``OUT`` in this process, one block of 8 queries at a
time, sleeping after each block is written and marked done (where the test's SIGKILL lands)."""

from __future__ import annotations

import sys
import time

import numpy as np

import classgrad.service.analysis.score_driver as driver
from classgrad.service.analysis import scoring
from classgrad.store import open_store

OPTIONS = {"method": "dot", "top_k": 5, "block_rows": 8, "full": True, "executor": "local"}


def _slow_task(*args):
    report = scoring.score_task(*args)
    time.sleep(0.5)
    return report


def main(argv: list[str]) -> int:
    url, queries, out = argv
    driver.score_task = _slow_task  # type: ignore[assignment]
    driver.score_rows([open_store(url, mode="r+")], [np.load(queries)], out=out, **OPTIONS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
