"""Compact stores end to end without Ray: projected rows and low-precision rows, written by the
real worker into a real store, against rows computed directly; and ``classgrad estimate``."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from classgrad.config import JobConfig
from classgrad.service.driver_runtime.estimate import RAY_STARTUP_ALLOWANCE_S, estimate_job
from classgrad.workers.actor_runtime.factory import build_model, build_probe
from classgrad.workers.gradients import per_class_gradients
from classgrad.workers.projection import Projector
from tests.support.jobs import MLP_JOB_CLASSES, mlp_job, run_without_ray

C = MLP_JOB_CLASSES


def direct_rows(config: JobConfig) -> torch.Tensor:
    model = build_model(config.model.factory, config.model.kwargs)
    probe = build_probe(config.data.factory, config.data.kwargs)
    return per_class_gradients(model, probe, num_classes=C)


@pytest.mark.parametrize("per_param", [False, True])
def test_projected_store_holds_projected_rows(tmp_path, per_param):
    # Dense: per_param implies it; without, it is asked for (the default is tensorsketch).
    proj = {"dim": 32, "kind": "gaussian", "seed": 7, "per_param": per_param} | (
        {} if per_param else {"structure": "dense"}
    )
    config = mlp_job(tmp_path, projection=proj)
    store = run_without_ray(config)
    full = direct_rows(config)
    groups = None
    if per_param:
        model = build_model(config.model.factory, config.model.kwargs)
        sizes = [p.numel() for p in model.parameters()]
        groups = [(int(sum(sizes[:i])), s) for i, s in enumerate(sizes)]
    projector = Projector(full.shape[1], 32, kind="gaussian", seed=7, groups=groups)
    expected = projector.project(full).numpy()
    assert store.dim == projector.out_dim == 32 * (len(groups) if groups else 1)
    assert store.layout == ()
    info = store.attrs["projection"]
    assert (info["kind"], info["dim"], info["seed"]) == ("gaussian", 32, 7)
    # Same rows, same R; only float32 summation order differs (blocks of rows vs all at once).
    np.testing.assert_allclose(store.rows(np.arange(C)), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,resolution", [("float16", 2.0**-11), ("bfloat16", 2.0**-8)])
def test_low_precision_store_keeps_rows_within_its_resolution(tmp_path, dtype, resolution):
    config = mlp_job(tmp_path, store={"dtype": dtype})
    store = run_without_ray(config)
    full = direct_rows(config).numpy()
    got = store.rows(np.arange(C))
    assert got.dtype == np.float32 and store.dtype == dtype
    # Each value is rounded once to the dtype after per-row scaling: error <= half an ulp of the
    # row's scale, i.e. <= resolution x (row max) (generous for values below the row max).
    row_max = np.abs(full).max(axis=1, keepdims=True)
    assert np.all(np.abs(got - full) <= resolution * row_max)


def test_estimate_reports_store_size_memory_and_rate(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # room for both actors: no core sharing
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local job, whose cores are os.cpu_count()
    config = mlp_job(tmp_path, store={"dtype": "float16"})
    result = estimate_job(config, sample_rows=8)
    dim = sum(p.numel() for p in build_model(config.model.factory, config.model.kwargs).parameters())
    assert result.dim == dim and result.store_bytes == C * dim * 2 + C * 16
    assert result.rows_per_s_per_actor > 0 and result.peak_memory_bytes > 0
    assert result.rows_per_s_job == pytest.approx(2 * result.rows_per_s_per_actor)
    assert result.engine == "partitioned" and result.sample_rows == 8
    text = "\n".join(result.lines())
    assert "float16" in text and "rows/s" in text and "peak RSS" in text
    assert not (tmp_path / "s.zarr").exists(), "estimate must not create the store"


def test_estimate_includes_start_up_in_the_wall_time(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    result = estimate_job(mlp_job(tmp_path), sample_rows=8)
    assert result.engine_build_seconds > 0 and result.ray_startup_seconds == RAY_STARTUP_ALLOWANCE_S
    assert result.startup_seconds == result.engine_build_seconds + RAY_STARTUP_ALLOWANCE_S  # same sum: exact
    assert result.wall_seconds == result.startup_seconds + result.job_seconds  # same sum: exact
    text = "\n".join(result.lines())
    assert "start-up" in text and "wall time" in text and "(start-up + compute)" in text
    assert result.to_dict()["wall_seconds"] == result.wall_seconds


def test_estimate_divides_cores_between_actors(tmp_path, monkeypatch):
    # 2 actors x 1 CPU on a machine reported as 1 core: they share it, so the job runs at one actor's rate.
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    result = estimate_job(mlp_job(tmp_path, cluster={"num_workers": 2, "num_cpus_per_worker": 1}), sample_rows=8)
    assert result.cores == 1 and result.actors_in_parallel == 1.0
    assert result.rows_per_s_job == result.rows_per_s_per_actor  # rate x 1.0: exact
    assert result.job_seconds == C / result.rows_per_s_per_actor  # C / (rate x 1.0): exact
    assert "actors share cores" in "\n".join(result.lines())


def test_estimate_assumes_a_clusters_actors_get_their_cpus(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # the driver's machine is not where a cluster's actors run
    config = mlp_job(tmp_path, cluster={"address": "10.0.0.1:6379", "num_workers": 3})
    result = estimate_job(config, sample_rows=8)
    assert result.cores is None and result.rows_per_s_job == 3 * result.rows_per_s_per_actor  # rate x 3.0: exact
