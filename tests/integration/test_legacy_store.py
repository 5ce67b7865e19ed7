"""A store written by classgrad before the namespace move and fingerprint v2 is resumed by today's
code: its recorded config names `workers.zoo:...` and its fingerprint is of the old scheme."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from classgrad.config import load_config
from classgrad.service.driver_runtime.driver import JobDriver
from classgrad.store import open_store
from tests.support.engine_cases import max_relative_error

pytestmark = pytest.mark.usefixtures("ray_local")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stores"
REDONE_SHARD = 1  # of 3 shards of 4 rows


def test_legacy_store_resumes_one_shard_with_the_same_rows(tmp_path: Path) -> None:
    copy = tmp_path / "v1_resume.zarr"
    shutil.copytree(FIXTURES / "v1_resume.zarr", copy)
    fixture = open_store(str(FIXTURES / "v1_resume.zarr"))
    expected = fixture.rows(np.arange(fixture.num_classes))
    old_fingerprint = fixture.fingerprint
    start, stop = fixture.shard_range(REDONE_SHARD)
    # The shard is marked not done and its rows wiped, so only a recomputation can restore them.
    zarr.open_array(str(copy / "shard_done"), mode="r+")[REDONE_SHARD] = 0
    zarr.open_array(str(copy / "grads"), mode="r+")[start:stop] = np.nan

    config = load_config(FIXTURES / "v1_resume.yaml", [f"store.url={copy}", "run.progress=log"])
    assert config.fingerprint() != old_fingerprint  # resumed although the schemes differ
    summary = JobDriver(config).run()

    assert summary.status == "complete", summary.error
    assert (summary.shards_done, summary.shards_skipped, summary.shards_total) == (1, 2, 3)
    assert summary.rows == stop - start
    store = open_store(str(copy))
    assert store.is_complete and store.fingerprint == old_fingerprint
    rows = store.rows(np.arange(store.num_classes))
    assert np.isfinite(rows).all()
    # Same model, data and CPU arithmetic as the run that wrote the fixture, so the rows normally
    # match bit for bit; a later torch may order float32 sums differently, so allow float32
    # roundoff over the short sums of this tiny MLP (normwise, as the engine contract states).
    assert max_relative_error(torch.from_numpy(rows), torch.from_numpy(expected)) <= 1e-6
    untouched = np.r_[0:start, stop : store.num_classes]
    np.testing.assert_array_equal(rows[untouched], expected[untouched])  # never rewritten
