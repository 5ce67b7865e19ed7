"""``classgrad score`` on a real local Ray: the tasks run in Ray worker processes, read the
stores' rows and write their blocks of the output themselves; the top-k and every score equal a
float64 brute force and the in-process executor's, for ``trak`` over two checkpoints' stores.
And a run SIGKILLed part-way (a process of its own, no Ray) resumes from the blocks it marked
done, with the results of an uninterrupted run."""

from __future__ import annotations

import os

import numpy as np
import xarray as xr

from classgrad.service.analysis.score_driver import score_rows
from classgrad.store import open_store
from tests.support.stores import synthetic_store


def test_ray_tasks_match_a_brute_force_and_the_local_executor(ray_local, tmp_path):
    phis, stores = [], []
    for seed in (0, 3):
        synthetic_store(tmp_path / f"s{seed}", num_classes=300, dim=32, projected=True, seed=seed)
        stores.append(open_store(str(tmp_path / f"s{seed}"), mode="r+"))
        phis.append(stores[-1].rows(np.arange(300)).astype(np.float64))
    rng = np.random.default_rng(0)
    queries = [rng.standard_normal((90, 32)).astype(np.float32) for _ in stores]
    out = str(tmp_path / "scores.zarr")
    options = {"method": "trak", "weights": [0.25, 1.0], "top_k": 5, "block_rows": 30}
    on_ray = score_rows(stores, queries, out=out, full=True, executor="ray", **options)
    assert on_ray.info["executor"] == "ray" and on_ray.info["tasks"] == 3
    local = score_rows(stores, queries, executor="local", **options)
    full = np.zeros((90, 300))
    for w, q, phi in zip((0.25, 1.0), queries, phis):
        gram = phi.T @ phi
        lam = 0.1 * np.trace(gram) / 32
        full += w * q.astype(np.float64) @ np.linalg.solve(gram + lam * np.eye(32), phi.T)
    # float32 products over 32 terms of float64-transformed rows: within 1e-5 of the largest score.
    atol = 1e-5 * np.abs(full).max()
    np.testing.assert_allclose(xr.open_zarr(out)["scores"].values, full, rtol=0, atol=atol)
    np.testing.assert_allclose(on_ray.scores.numpy(), -np.sort(-full, axis=1)[:, :5], rtol=0, atol=atol)
    np.testing.assert_allclose(on_ray.scores.numpy(), local.scores.numpy(), rtol=0, atol=atol)
    assert (on_ray.class_ids == local.class_ids).float().mean() > 0.99  # near-ties may swap
    assert os.getpid() not in on_ray.info["task_pids"]  # computed in Ray workers, not here


def test_a_score_run_killed_part_way_resumes(tmp_path):
    """SIGKILL while blocks are being scored; the rerun skips the blocks marked done and its
    results equal a brute force (no Ray: the run is in one process, killed as a whole)."""
    import signal
    import subprocess
    import sys

    from tests.support.harness import REPO, repo_env, wait_for
    from tests.support.score_kill import OPTIONS

    synthetic_store(tmp_path / "s", num_classes=200, dim=24, projected=True)
    store = open_store(str(tmp_path / "s"), mode="r+")
    queries = np.random.default_rng(1).standard_normal((64, 24)).astype(np.float32)
    np.save(tmp_path / "q.npy", queries)
    out = tmp_path / "scores.zarr"
    args = [sys.executable, "-m", "tests.support.score_kill", str(tmp_path / "s"), str(tmp_path / "q.npy"), str(out)]
    proc = subprocess.Popen(args, cwd=REPO, env=repo_env(), start_new_session=True)
    try:

        def two_done() -> bool:
            try:
                return int(xr.open_zarr(out, consolidated=False)["block_done"].values.sum()) >= 2
            except (FileNotFoundError, KeyError, OSError, ValueError):
                return False

        wait_for(two_done, 120, "two query blocks done", alive=proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    done = int(xr.open_zarr(out, consolidated=False)["block_done"].values.sum())
    assert 2 <= done < 8  # killed part-way
    result = score_rows([store], [queries], out=str(out), **OPTIONS)
    assert result.info["blocks_skipped"] == done and result.info["tasks"] == 8 - done
    full = queries.astype(np.float64) @ store.rows(np.arange(200)).astype(np.float64).T
    # float32 products over 24 terms: within 1e-5 of the largest score.
    atol = 1e-5 * np.abs(full).max()
    np.testing.assert_allclose(xr.open_zarr(out)["scores"].values, full, rtol=0, atol=atol)
    np.testing.assert_allclose(result.scores.numpy(), -np.sort(-full, axis=1)[:, :5], rtol=0, atol=atol)
