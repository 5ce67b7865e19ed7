"""``GradLog`` under ``torch.distributed``: two gloo processes, each given half of every batch,
write the log one process writes over the whole batches (``tests/support/grad_log_run.py``)."""

from __future__ import annotations

import numpy as np
import torch.multiprocessing as mp

from classgrad.store import read_log
from tests.support import grad_log_run as run


def test_two_ranks_write_the_log_of_one_process_over_the_concatenated_batches(tmp_path):
    one, two = str(tmp_path / "one.zarr"), str(tmp_path / "two.zarr")
    run.rows_only(one, steps=4)
    mp.spawn(run.ddp_rank, args=(2, str(tmp_path / "rendezvous"), two, 4), nprocs=2, join=True)
    a, b = read_log(one), read_log(two)
    assert a["window"].tolist() == b["window"].tolist() == [0, 1]
    assert np.array_equal(a["count"], b["count"]) and np.array_equal(a["steps"], b["steps"])
    for name in ("grads", "lr_grads"):
        # Each class's mean over its samples, formed as the ranks' means weighted by their shares
        # and summed across ranks, against the mean over all of them at once: float32 roundoff.
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
