"""``classgrad score`` on a real local Ray: the tasks run in Ray worker processes, read the
stores' rows and write their blocks of the output themselves; the top-k and every score equal a
float64 brute force and the in-process executor's, for ``trak`` over two checkpoints' stores."""

from __future__ import annotations

import os

import numpy as np
import xarray as xr

from classgrad.service.analysis.score_driver import score_rows
from classgrad.service.store import open_store
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
