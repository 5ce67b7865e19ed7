"""Two plain processes (no Ray) that take the same new store at the same moment, many times.

Holds ``CONFIGS`` (two store configs that differ in the store's attributes and in the ``grads``
array's metadata, and in the value of every row), ``race`` (runs the trials: two spawned
processes, a barrier before each trial, returns what each process said per trial) and
``check_trial`` (what the store of one trial holds, against the config that won it).

Each process takes a store the way a driver does (``order="lease-first"``: the store's lease,
then ``create_store`` under it) or the way drivers did before the lease came first
(``"create-then-lease"``: ``create_store``, then the lease), writes every row with its value
and marks every shard done.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from typing import Any

import numpy as np
import zarr

# name -> (fingerprint, dtype, col_chunk, value of every row)
CONFIGS: dict[str, tuple[str, str, int, float]] = {
    "A": ("fp-race-A", "float32", 6, 1.0),
    "B": ("fp-race-B", "float16", 3, 2.0),
}
NUM_CLASSES, DIM, SHARD_ROWS = 8, 6, 4


def _spec(name: str) -> Any:
    from classgrad.store import StoreSpec

    fingerprint, dtype, col_chunk, _ = CONFIGS[name]
    return StoreSpec(
        num_classes=NUM_CLASSES,
        dim=DIM,
        shard_rows=SHARD_ROWS,
        row_chunk=SHARD_ROWS,
        col_chunk=col_chunk,
        dtype=dtype,
        fingerprint=fingerprint,
    )


def _fill(store: Any, value: float) -> None:
    for shard in range(store.num_shards):
        start, stop = store.shard_range(shard)
        rows = np.full((stop - start, DIM), value, dtype=np.float32)
        store.write_rows(start, rows, loss=np.full(stop - start, value), count=np.ones(stop - start))
        store.mark_shard_done(shard)


def _take(url: str, name: str, run_id: str, order: str) -> None:
    from classgrad.store import create_store

    value = CONFIGS[name][3]
    if order == "lease-first":
        from classgrad.store import store_lease

        with store_lease(url).hold(run_id, ttl_s=30.0) as held:
            _fill(create_store(url, _spec(name), lease=held), value)
    else:
        store = create_store(url, _spec(name))
        with store.lease.hold(run_id, ttl_s=30.0):
            _fill(store, value)


def _worker(name: str, urls: list[str], order: str, barrier: Any, results: Any) -> None:
    from classgrad.errors import LeaseHeldError, StoreMismatchError

    for trial, url in enumerate(urls):
        try:
            barrier.wait(timeout=30)
        except Exception:  # the other process is gone: nothing left to race
            return
        try:
            _take(url, name, f"run-{name}-{trial}", order)
            outcome = "won"
        except (LeaseHeldError, StoreMismatchError) as exc:  # refused in one line: the expected loss
            outcome = f"refused: {exc}"
        except Exception as exc:
            outcome = f"error: {type(exc).__name__}: {exc}"
        results.put((trial, name, outcome))


def race(urls: list[str], order: str = "lease-first", timeout_s: float = 120.0) -> dict[int, dict[str, str]]:
    """Run one trial per url with both configs' processes released together; trial -> name -> outcome."""
    ctx = mp.get_context("spawn")  # no fork: zarr's event-loop thread must not be copied
    barrier, results = ctx.Barrier(len(CONFIGS)), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(name, urls, order, barrier, results)) for name in CONFIGS]
    for proc in procs:
        proc.start()
    outcomes: dict[int, dict[str, str]] = {}
    try:
        for _ in range(len(urls) * len(CONFIGS)):
            trial, name, outcome = results.get(timeout=timeout_s)
            outcomes.setdefault(trial, {})[name] = outcome
    except queue.Empty:
        pass
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return outcomes


def check_trial(url: str, outcome: dict[str, str]) -> list[str]:
    """What is wrong with one trial: not exactly one winner, or a store that is not all the winner's."""
    from classgrad.store import open_store

    winners = [name for name, said in outcome.items() if said == "won"]
    others = [f"{name}: {said}" for name, said in outcome.items() if said != "won" and not said.startswith("refused")]
    if len(outcome) != len(CONFIGS):
        return [f"only {sorted(outcome)} reported"]
    if len(winners) != 1 or others:
        return [f"{len(winners)} winners; {others or outcome}"]
    fingerprint, dtype, col_chunk, value = CONFIGS[winners[0]]
    problems = []
    store = open_store(url)
    if store.fingerprint != fingerprint or store.dtype != dtype or store.col_chunk != col_chunk:
        problems.append(f"attributes {store.fingerprint}/{store.dtype}/{store.col_chunk} are not {winners[0]}'s")
    grads = zarr.open_group(url, mode="r")["grads"]
    storage = "float16" if dtype == "float16" else "float32"
    if grads.chunks != (SHARD_ROWS, col_chunk) or str(grads.dtype) != storage:
        problems.append(f"grads metadata {grads.chunks}/{grads.dtype} is not {winners[0]}'s")
    if not store.is_complete:
        problems.append("not every shard is done")
    else:
        rows = store.rows(range(NUM_CLASSES))
        if not np.array_equal(rows, np.full_like(rows, value)):  # 1.0 and 2.0 are exact in both dtypes
            problems.append(f"rows are not all {value} ({winners[0]}'s): {np.unique(rows)}")
    return problems
