"""The memory bound of ``classgrad similarity --top-k-only`` on wide rows, measured.

Issue 29: on a 5,000 x 155,912 store a top-k-only run's tasks added 843.7 MiB against a bound
of 473.1 MiB (the float64 copies of 256 full rows for their norms were outside the bound) and
read the store 14 times over. Here the same aspect, scaled down (256 classes x 12,800 columns,
so a row is 50 times wider than the store is tall), is run in a fresh process, as a Ray worker
would run it, with the module's own accounting (``PeakMemory``: the kernel's high-water mark of
the process's resident memory, from before the task opens the store to its end): every task
stays within the plan's bound, and the store is read the plan's number of passes, which column
bands (a store whose column chunks are narrower than a row) bring down to two.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import pytest

from classgrad.service.analysis.similarity import SimilarityConfig
from classgrad.service.analysis.topk_plan import plan_topk
from tests.support.harness import REPO
from tests.support.stores import synthetic_store

C, D = 256, 12_800
TASK_MB = 36  # small enough for several tasks of full rows (a row is 50 KiB)

# The tasks of one store, one after another in a fresh process (as a Ray worker runs them).
_RUN = """
import json, sys
from classgrad.service.analysis.similarity_topk import topk_task
url, plan, blocks = json.loads(sys.argv[1])
print(json.dumps([topk_task(url, None, plan, a, b, "memtest") for a, b in blocks]))
"""
COL_CHUNKS = {"full_row_chunks": 1 << 20, "narrow_column_chunks": 1_600}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple]:
    """(plan, task reports) of a top-k-only run on each store; both processes run at once."""
    started = {}
    for name, col_chunk in COL_CHUNKS.items():
        url = str(tmp_path_factory.mktemp(name) / "wide.zarr")
        store, _ = synthetic_store(url, num_classes=C, dim=D, col_chunk=col_chunk, shard_rows=64)
        plan = plan_topk(store, SimilarityConfig(dense=False, top_k=10, task_mb=TASK_MB))
        store.similarity_arrays.begin(
            metric=plan.metric, top_k=plan.top_k, chunk_rows=plan.chunk_rows, run_id="memtest", dense=False
        )
        argv = json.dumps([url, asdict(plan), plan.blocks()])
        proc = subprocess.Popen(
            [sys.executable, "-c", _RUN, argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
        )
        started[name] = (plan, proc)
    done = {}
    for name, (plan, proc) in started.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        done[name] = (plan, json.loads(out.strip().splitlines()[-1]))
    return done


@pytest.mark.parametrize("name", list(COL_CHUNKS))
def test_every_task_stays_within_the_bound_on_wide_rows(runs, name):
    plan, reports = runs[name]
    col_chunk = COL_CHUNKS[name]
    bound = plan.memory_bound()["total"]
    assert bound <= TASK_MB << 20
    for report in reports:
        assert report["exact_peak"]  # the kernel's high-water mark, not a sampled one
        # No tolerance: the bound's slack is the measured spread of a fresh process's fixed part
        # (interpreter, torch, zarr's threads and arenas; similarity_topk._SLACK_BYTES).
        assert report["rss_added"] <= bound, (report, plan.memory_bound())
    # The first task runs in a fresh process (nothing kept from earlier work): it really held
    # its query block, so the measurement is not vacuous.
    first = reports[0]
    assert first["rss_added"] >= plan.block_rows * min(plan.band_cols, D) * 4
    # Each row is read the plan's number of passes: once per task, plus the query reads.
    assert sum(r["read_bytes"] for r in reports) == plan.passes() * C * D * 4
    if col_chunk < D:  # bands: one task holds every row's scores, two passes over the store
        assert len(reports) == 1 and plan.passes() == 2 and plan.band_cols < D
    else:
        assert len(reports) > 1 and plan.passes() == len(reports) + 1
