"""``GradLog``: a training run's per-class rows summed over windows of steps (issue 48, its core).

The run is ``tests/support/grad_log_run.py``: a seeded MLP, ``PerClassGradScaler.step_batch``
each step, windows of 2 steps, rows sketched to 32 columns.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from classgrad import GradLog, PerClassGradScaler, per_class_gradients
from classgrad.errors import InputError, StoreMismatchError
from classgrad.store import read_log
from tests.support import grad_log_run as run
from tests.support.docs import python_blocks

REPO = Path(__file__).resolve().parents[2]


def test_a_window_is_the_float64_rows_of_its_steps_summed_and_projected(tmp_path):
    model, opt = run.fresh()
    scaler = PerClassGradScaler()
    url = str(tmp_path / "log.zarr")
    want: dict[int, dict[str, torch.Tensor]] = {}
    with GradLog(url, model, run.C, window=run.WINDOW, dim=run.DIM) as log:
        for step in range(5):  # windows 0, 1 and a last one of one step
            x, y = run.batch(step)
            ids = torch.unique(y)
            ref = per_class_gradients(
                copy.deepcopy(model).double(),
                (x.double(), y),
                num_classes=run.C,
                classes=ids.tolist(),
                engine="reference",
            )
            sums = want.setdefault(step // run.WINDOW, {"grads": torch.zeros(run.C, ref.shape[1], dtype=torch.float64)})
            sums["grads"][ids] += ref.double()
            opt.zero_grad()
            rows, got_ids = scaler.step_batch(model, x, y, opt, num_classes=run.C)
            assert torch.equal(got_ids, ids)
            log.add(step, rows, got_ids, lr=run.LR, counts=torch.bincount(y, minlength=run.C)[ids])
        projector = log.projector
    stored = read_log(url)
    assert stored["window"].tolist() == [0, 1, 2]
    assert stored["steps"].tolist() == [[0, 2], [2, 4], [4, 5]]
    for w, sums in want.items():
        expected = projector.project(sums["grads"]).numpy()
        # float32 rows (engine roundoff ~1e-7 relative) summed over 2 steps and sketched.
        np.testing.assert_allclose(stored["grads"][w], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stored["lr_grads"][w], run.LR * expected, rtol=1e-5, atol=1e-7)
    counts = np.zeros((3, run.C), dtype=np.int64)
    for step in range(5):
        counts[step // run.WINDOW] += np.bincount(run.batch(step)[1].numpy(), minlength=run.C)
    assert np.array_equal(stored["count"], counts)


def test_xarray_reads_the_log_with_its_dimensions(tmp_path):
    xr = pytest.importorskip("xarray")
    url = str(tmp_path / "log.zarr")
    run.train(url, str(tmp_path / "ckpt.pt"), 0, 4)
    ds = xr.open_zarr(url, consolidated=False)
    assert ds["grads"].dims == ("window", "class_id", "column")
    assert ds["grads"].shape == (2, run.C, run.DIM) and ds["steps"].dims == ("window", "bound")


def test_open_log_dataset_reads_the_done_windows_lazily_and_checks_each_block(tmp_path):
    """``open_log_dataset``: the done windows as a Dataset equal to ``read_log``'s arrays (the sums
    dask-backed, a task per window and block), and a damaged block refused when computed."""
    pytest.importorskip("xarray")
    pytest.importorskip("dask")
    from classgrad.errors import StoreError
    from classgrad.store import open_log_dataset

    url = str(tmp_path / "log.zarr")
    run.train(url, str(tmp_path / "ckpt.pt"), 0, 4)
    ds, want = open_log_dataset(url), read_log(url)
    assert ds["grads"].dims == ("window", "class_id", "column") and ds["window"].values.tolist() == [0, 1]
    assert ds["grads"].chunks is not None and len(ds["grads"].chunks[0]) == 2
    for name in ("grads", "lr_grads", "count", "loss_sum", "steps"):
        assert np.array_equal(ds[name].values, want[name]), name
    shard = next(p for p in (tmp_path / "log.zarr" / "lr_grads" / "c" / "1").rglob("*") if p.is_file())
    blob = bytearray(shard.read_bytes())
    blob[0] ^= 1  # a stored row's first byte
    shard.write_bytes(bytes(blob))
    ds = open_log_dataset(url)
    assert np.array_equal(ds["grads"].values, want["grads"])  # the other array reads as it was
    with pytest.raises(StoreError, match="lr_grads of window 1, rows .* does not match its record"):
        ds["lr_grads"].compute()


def test_a_run_killed_mid_window_resumes_from_its_checkpoint_without_doubling(tmp_path):
    """The child process kills itself (SIGKILL) before step 5, inside window 2; the rerun starts
    from the checkpoint of step 4 and ends with the log an uninterrupted run writes."""
    clean, broken = str(tmp_path / "clean.zarr"), str(tmp_path / "broken.zarr")
    run.train(clean, str(tmp_path / "clean.pt"), 0, 8)
    ckpt = str(tmp_path / "broken.pt")
    child = subprocess.run(
        [sys.executable, "-m", "tests.support.grad_log_run", broken, ckpt, "0", "8", "5"], cwd=REPO, timeout=300
    )
    assert child.returncode == -9
    assert read_log(broken)["window"].tolist() == [0, 1]  # window 2 was in progress: absent
    assert torch.load(ckpt, weights_only=True)["step"] == 4
    run.train(broken, ckpt, 4, 8)
    a, b = read_log(clean), read_log(broken)
    assert a["window"].tolist() == b["window"].tolist() == [0, 1, 2, 3]
    for name in ("grads", "lr_grads", "count", "steps"):
        # The same steps on the same machine and threads; a tolerance for a fresh process's
        # kernel choices, not for any change in what is summed.
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-8, err_msg=name)


def test_another_run_is_refused_in_one_line(tmp_path):
    url = str(tmp_path / "log.zarr")
    run.train(url, str(tmp_path / "ckpt.pt"), 0, 4)
    model, _ = run.fresh()
    for kwargs, word in [
        ({"window": 3}, "window"),
        ({"window": run.WINDOW, "dim": 16}, "width"),
        ({"window": run.WINDOW, "seed": 1}, "projection"),
    ]:
        with pytest.raises(StoreMismatchError, match=word) as caught:
            GradLog(url, model, run.C, **{"dim": run.DIM, **kwargs})
        assert "\n" not in str(caught.value)
    other = torch.nn.Sequential(torch.nn.Linear(8, run.C))
    with pytest.raises(StoreMismatchError, match="layout"):
        GradLog(url, other, run.C, window=run.WINDOW, dim=run.DIM)
    with pytest.raises(InputError, match="window boundary"):
        GradLog(url, model, run.C, window=run.WINDOW, dim=run.DIM, start_step=3)
    log = GradLog(url, model, run.C, window=run.WINDOW, dim=run.DIM, start_step=2)  # drops window 1
    assert log.store.done == [0]
    with pytest.raises(InputError, match="steps must increase"):
        log.add(2, torch.zeros(1, log.layout.dim), torch.tensor([0]))
        log.add(2, torch.zeros(1, log.layout.dim), torch.tensor([0]))
    with pytest.raises(InputError, match="window must be"):
        GradLog(str(tmp_path / "other.zarr"), model, run.C, window=0)


def test_the_readme_training_run_snippets_run(tmp_path, monkeypatch):
    """The README's "Over a training run" snippets (the plain loop's log and the Lightning
    callback's), after its "In a training loop" one (which defines the model, batches and
    scaler), as written, in a scratch folder."""
    text = (REPO / "README.md").read_text()

    monkeypatch.chdir(tmp_path)
    (tmp_path / "stores").mkdir()
    namespace: dict = {}
    for block in python_blocks(text, "## In a training loop")[:1] + python_blocks(text, "## Over a training run"):
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - our own docs
    for name in ("windows", "lightning_windows"):
        windows = namespace[name]
        assert windows["window"].tolist() == [0, 1]  # 3 batches, windows of 2 steps
        assert windows["grads"].shape == (2, 100, 256) and windows["count"].sum() == 3 * 64


def test_a_path_that_holds_another_zarr_group_is_not_made_a_log(tmp_path):
    import zarr

    url = str(tmp_path / "store.zarr")
    zarr.open_group(url, mode="w").create_array("grads", shape=(2, 2), dtype="float32")
    model, _ = run.fresh()
    with pytest.raises(StoreMismatchError, match="not a grad log"):
        GradLog(url, model, run.C, window=run.WINDOW, dim=run.DIM)
