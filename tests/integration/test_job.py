"""The distributed job on a local Ray with 2 actors: correct rows, each shard once, faults."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from classgrad.service.driver_runtime.driver import JobDriver
from classgrad.store import open_store
from classgrad.workers.actor_runtime.factory import build_model, build_probe
from classgrad.workers.gradients import per_class_gradients
from tests.support.engine_cases import max_relative_error
from tests.support.harness import classgrad_cli

pytestmark = pytest.mark.usefixtures("ray_local")


def reference_rows(config) -> torch.Tensor:
    """Rows of the float64 reference engine for the job's model, data and loss."""
    model = build_model(config.model.factory, config.model.kwargs, mode=config.model.mode).double()
    probe = build_probe(config.data.factory, config.data.kwargs, config.data.batch_size)
    return per_class_gradients(
        model, probe, num_classes=config.loss.num_classes, loss=config.loss.kind, engine="reference"
    )


@pytest.mark.parametrize("loss,engine", [("cross_entropy", "partitioned"), ("logit", "dense")])
def test_two_actors_store_rows_equal_to_reference(job_config, loss, engine):
    # Both actors compute (each one's peak is checked below): the job starts once both are ready.
    config = job_config(loss={"kind": loss}, engine={"kind": "auto"}, cluster={"min_workers": 2})
    driver = JobDriver(config)
    summary = driver.run()
    store = open_store(config.store.url)
    assert summary.status == "complete" and summary.engine == engine
    assert store.is_complete and summary.shards_done == store.num_shards == 12
    # Every shard computed exactly once: no retries, no duplicates.
    assert dict(driver.completions) == {i: 1 for i in range(12)} and summary.retries == 0
    rows = torch.from_numpy(store.rows(np.arange(48)))
    # float32 rows against the float64 reference: the engine contract (see tests/unit/test_engines.py).
    assert max_relative_error(rows, reference_rows(config)) <= 1e-6
    assert store.runs[-1]["status"] == "complete"
    # The preflight's estimate beside each actor's measured peak RSS, in the run history (issue 25).
    memory = store.runs[-1]["memory"]
    assert memory["estimate"]["actor_bytes"] > 0 and len(memory["peak_rss_per_actor"]) == 2, memory
    assert all(peak > 0 for peak in memory["peak_rss_per_actor"].values())
    assert "estimate ~" in "\n".join(summary.lines()) and "measured peak RSS" in "\n".join(summary.lines())


def _kill_one_actor_when(driver: JobDriver, ray, shards_done: int, killed: list) -> None:
    # Counted from before the driver starts its actors, which a loaded machine can take a minute
    # over; a run that ended first leaves nobody to kill (the test then says so).
    deadline = time.monotonic() + 300
    while driver.summary.shards_done < shards_done and time.monotonic() < deadline:
        if driver.summary.status != "running":
            return
        time.sleep(0.05)
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"classgrad-{driver.run_id}-w0-")
    ]
    ray.kill(
        ray.get_actor(
            names[0],
            namespace=next(
                a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == names[0]
            ),
        )
    )
    killed.append(names[0])


def test_killed_actor_is_replaced_and_rows_match_an_uninterrupted_run(job_config, ray_local, tmp_path):
    slow = {
        "factory": "tests.support.slow_models:slow_mlp",
        "kwargs": {"num_classes": 48, "delay_s": 0.15, "in_features": 8, "hidden": 16},
    }
    data = {"kwargs": {"num_classes": 48, "samples_per_class": 3, "kind": "vector", "input_shape": [8], "seed": 2}}
    config = job_config(model=slow, data=data)
    driver = JobDriver(config)
    killed: list[str] = []
    killer = threading.Thread(target=_kill_one_actor_when, args=(driver, ray_local, 2, killed))
    killer.start()
    summary = driver.run()
    killer.join()
    assert killed, "the actor was not killed"
    assert summary.status == "complete" and summary.actors_replaced >= 1 and summary.retries >= 1
    assert sorted(driver.completions) == list(range(12))
    store = open_store(config.store.url)
    assert store.is_complete
    assert store.runs[-1]["retries"] == summary.retries >= 1

    clean_url = str(tmp_path / "clean.zarr")
    clean = job_config(model=slow, data=data, store={"url": clean_url})
    assert JobDriver(clean).run().retries == 0
    # Same shards, same engine, same CPU arithmetic: the recomputed rows are bit-identical.
    np.testing.assert_array_equal(store.rows(np.arange(48)), open_store(clean_url).rows(np.arange(48)))


def test_status_json_has_the_startup_compute_split_and_engine_notes(job_config):
    config = job_config(loss={"kind": "logit"}, engine={"kind": "dense"})
    summary = JobDriver(config).run()
    assert summary.status == "complete"
    proc = classgrad_cli("status", config.store.url, "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout)["last_run"]
    assert last["startup_s"] > 0 and last["compute_s"] > 0
    # The two parts make up the whole run (JSON floats: equal to within rounding).
    assert last["startup_s"] + last["compute_s"] == pytest.approx(last["seconds"], abs=1e-6)
    # The rate is over compute alone.
    assert last["rows_per_s"] == pytest.approx(last["rows"] / last["compute_s"], rel=1e-6)
    # The dense engine notes the block size it chose (and any fallback it took).
    assert last["engine_notes"] and any("dense" in note for note in last["engine_notes"])
    text = classgrad_cli("status", config.store.url, timeout=120).stdout
    assert "of compute" in text and "start-up" in text and "engine: " in text
