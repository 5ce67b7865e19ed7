"""A job file that names an engine, a loss and a projection structure registered outside the
package (``tests/support/toy_plugins.py``, imported through ``engine.plugins`` by the driver and
by every actor) runs with ``classgrad run`` and resumes, and stores the rows the built-in names
give (the toys are the built-ins under other names); so does a job naming a structure that
projects inside the backward, registered the same way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from classgrad.service.analysis.verify import verify_store
from classgrad.store import open_store
from tests.support.harness import classgrad_cli
from tests.support.jobs import small_job

MLP = {
    "model": {"factory": "classgrad.workers.zoo:mlp", "kwargs": {"num_classes": 48, "in_features": 8, "hidden": 16}},
    "data": {"kwargs": {"num_classes": 48, "samples_per_class": 3, "kind": "vector", "input_shape": [8], "seed": 2}},
}


def _job(tmp_path, name: str, engine: dict, loss: str, structure: str) -> tuple[str, str]:
    url = str(tmp_path / f"{name}.zarr")
    job = small_job(url, **MLP, engine=engine, loss={"kind": loss}, projection={"dim": 16, "structure": structure})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path), url


def test_a_job_of_registered_names_runs_resumes_and_equals_the_built_ins(tmp_path):
    builtin, builtin_url = _job(tmp_path, "builtin", {"kind": "partitioned"}, "cross_entropy", "sketch")
    toy_engine = {"kind": "toy_partitioned", "plugins": ["tests.support.toy_plugins"]}
    toy, toy_url = _job(tmp_path, "toy", toy_engine, "toy_ce", "toy_sketch")
    for config in (builtin, toy):
        done = classgrad_cli("run", config, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    # Shard 3 (rows 12-15) damaged, found and unmarked: the rerun computes it alone, its actors
    # importing the plugins again.
    chunk = Path(toy_url) / "grads" / "c" / "6" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    assert 3 in verify_store(toy_url, repair=True).repaired
    done = classgrad_cli("run", toy, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 computed, 11 already done" in done.stdout and "engine      toy_partitioned" in done.stdout, done.stdout
    a, b = open_store(builtin_url), open_store(toy_url)
    # The same engine, loss and map under other names, on the same machine: the same numbers.
    np.testing.assert_array_equal(a.rows(np.arange(48)), b.rows(np.arange(48)))


def test_a_registered_structure_that_projects_in_the_backward_runs_and_resumes(tmp_path):
    """``toy_tensorsketch``: one subclass and one registration, its engine and layer sums given by
    the registration; its store records its name, so a rerun resumes it and checks the map."""
    builtin, builtin_url = _job(tmp_path, "builtin", {"kind": "partitioned"}, "cross_entropy", "tensorsketch")
    toy_engine = {"kind": "partitioned", "plugins": ["tests.support.toy_plugins"]}
    toy, toy_url = _job(tmp_path, "toy", toy_engine, "cross_entropy", "toy_tensorsketch")
    for config in (builtin, toy, toy):
        done = classgrad_cli("run", config, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "0 computed, 12 already done" in done.stdout, done.stdout
    a, b = open_store(builtin_url), open_store(toy_url)
    assert b.attrs["projection"]["structure"] == "toy_tensorsketch"
    assert {k: v for k, v in b.attrs["projection"].items() if k != "structure"} == {
        k: v for k, v in a.attrs["projection"].items() if k != "structure"
    }
    np.testing.assert_array_equal(a.rows(np.arange(48)), b.rows(np.arange(48)))
