"""A checkpoint swapped between an interrupted run and its rerun (issue 15, item 1).

``classgrad run`` as a user runs it (a subprocess with its own local Ray) on a job whose
``model.checkpoint`` is a file: the first run stops with 11 of its 12 shards done (a loss that
fails on one class, ``sharding.max_attempts: 1``: ``tests/support/faulty.py``); other weights
are then copied over the same checkpoint path, as ``latest.pt``-style checkpoints are. The
config's text, and so its fingerprint, is unchanged, but the rerun is refused in one line that
names the model's parameters, and writes nothing: the store's files stay byte for byte as they
were. With the original weights restored, the rerun computes only the missing shard and the
store holds exactly the rows of an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from classgrad.config import JobConfig
from classgrad.store import open_store
from tests.support import faulty
from tests.support.harness import (
    assert_identical,
    classgrad_cli,
    error_lines,
    fault_job,
    store_arrays,
    uninterrupted,
    write_job,
)

NUM_SHARDS = 12  # 48 classes, shards of 4 rows
FAIL_CLASS = 41  # shard 10 (rows 40-43): not among the 4 samples the driver's preflight uses
JOB_TIMEOUT_S = 240


def save_weights(path: Path, seed: int) -> None:
    """The job's model (``fault_job``'s MLP) with the weights of ``seed``: same keys and shapes."""
    torch.save(faulty.unhooked_mlp(48, in_features=8, hidden=16, seed=seed).state_dict(), path)


def files_of(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}


def test_a_checkpoint_swapped_between_an_interrupted_run_and_its_rerun_is_refused(tmp_path):
    checkpoint = tmp_path / "latest.pt"
    save_weights(checkpoint, seed=0)
    plan = faulty.write_plan(tmp_path / "faults", fail_class=FAIL_CLASS, fail_times=1)
    url = str(tmp_path / "swap.zarr")
    job = fault_job(url, plan, sharding={"max_attempts": 1}, model={"checkpoint": str(checkpoint)})
    config = write_job(tmp_path / "swap.yaml", job)

    first = classgrad_cli("run", config, timeout=JOB_TIMEOUT_S)
    assert first.returncode == 2, first.stderr[-3000:]
    assert open_store(url).shard_done.sum() == NUM_SHARDS - 1  # every shard but the failing one
    before = files_of(Path(url))

    save_weights(checkpoint, seed=1)  # other weights at the same path: the config text is unchanged
    rerun = classgrad_cli("run", config, timeout=JOB_TIMEOUT_S)

    assert rerun.returncode == 2, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    assert "Traceback" not in rerun.stderr
    (line,) = error_lines(rerun.stderr)
    assert f"holds {NUM_SHARDS - 1} done shards computed from other inputs: the model's parameters/buffers" in line
    assert "restore the inputs" in line and "store.overwrite=true" in line, line
    assert files_of(Path(url)) == before  # nothing written: no row, no shard, no run record, no lease

    save_weights(checkpoint, seed=0)  # the inputs restored: the store is resumed
    restored = classgrad_cli("run", config, timeout=JOB_TIMEOUT_S)
    assert restored.returncode == 0, restored.stderr[-3000:]
    assert f"1 computed, {NUM_SHARDS - 1} already done" in restored.stdout
    clean_job = fault_job(str(tmp_path / "clean.zarr"), model={"checkpoint": str(checkpoint)})
    assert_identical(store_arrays(url), uninterrupted(JobConfig.model_validate(clean_job)))
