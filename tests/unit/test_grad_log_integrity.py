"""The training log's integrity (issue 60, items 1, 2 and 4): no resume leaves a hole, `all`
never skips one, every chunk of a done window is checked against its window's record, and a
damaged log is refused in one line.

The log is ``tests/support/grad_log_run.py``'s: windows of 2 steps, rows sketched to 32 columns.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import zarr

from classgrad import GradLog
from classgrad.errors import InputError, StoreError, StoreIncompleteError
from classgrad.service.commands.cli import main as cli_main
from classgrad.store import read_log
from tests.support import grad_log_run as run


@pytest.fixture(scope="module")
def sound(tmp_path_factory):
    """A log of 8 steps: windows 0-3."""
    tmp = tmp_path_factory.mktemp("sound")
    url = str(tmp / "log.zarr")
    run.train(url, str(tmp / "ckpt.pt"), 0, 8)
    return url


@pytest.fixture
def log(sound, tmp_path):
    shutil.copytree(sound, tmp_path / "log.zarr")
    return tmp_path / "log.zarr"


def _done(path, windows):
    group = zarr.open_group(str(path), mode="r+")
    group.attrs["done_windows"] = windows


def test_a_resume_past_a_window_never_written_is_refused(log):
    """Before: killed after the checkpoint of step 6 but before window 2 was written, the resume
    at step 6 logged windows 3 on and the log read [0, 1, 3]: window 2 gone for good."""
    _done(log, [0, 1])  # window 2 never written
    model, _ = run.fresh()
    with pytest.raises(StoreIncompleteError, match=r"window 2 \(steps 4-5\) was never written.*at step 4 or before"):
        GradLog(str(log), model, run.C, window=run.WINDOW, dim=run.DIM, start_step=6)
    assert read_log(str(log))["window"].tolist() == [0, 1]  # nothing dropped
    GradLog(str(log), model, run.C, window=run.WINDOW, dim=run.DIM, start_step=4)  # from the hole: fine


def test_reopening_a_log_without_start_step_is_refused_not_emptied(log):
    """Before: ``GradLog(url, ...)`` on a log of 4 windows silently dropped them all."""
    model, _ = run.fresh()
    with pytest.raises(InputError, match=r"already holds windows 0-3: pass start_step="):
        GradLog(str(log), model, run.C, window=run.WINDOW, dim=run.DIM)
    assert read_log(str(log))["window"].tolist() == [0, 1, 2, 3]


def test_all_windows_of_a_log_with_a_hole_is_refused_and_a_range_without_it_is_read(log, capsys):
    _done(log, [0, 1, 3])
    assert cli_main(["similarity", str(log), "--window", "0"]) == 0
    capsys.readouterr()
    queries = log.parent / "q.yaml"
    queries.write_text(
        "data:\n  factory: classgrad.workers.zoo:synthetic_probe\n"
        f"  kwargs: {{num_classes: {run.C}, samples_per_class: 2, kind: vector, input_shape: [8], seed: 5}}\n"
    )
    argv = ["score", str(log), "--queries", str(queries), "--model", "classgrad.workers.zoo:mlp"]
    argv += ["--model-kwargs", "{num_classes: 6, in_features: 8, hidden: 16, seed: 3}"]
    assert cli_main([*argv, "--windows", "all"]) == 2
    err = capsys.readouterr().err.strip()
    assert "lacks window(s) 2 among its done windows 0-1, 3: --windows all would leave them out" in err
    assert "\n" not in err
    # plot: its norms span every window, so it refuses too, unless windows without the hole are named.
    assert cli_main(["plot", str(log), "--out", str(log.parent / "png")]) == 2
    assert "lacks window(s) 2" in capsys.readouterr().err
    assert cli_main(["plot", str(log), "--out", str(log.parent / "png"), "--windows", "3", "--dpi", "40"]) == 0


@pytest.mark.parametrize("damage", ["delete", "flip", "copy"])
def test_a_damaged_chunk_of_a_done_window_is_refused_on_every_read(log, damage):
    """Before: a deleted chunk read as zeros, a flipped byte or a chunk copied from another
    window changed the rows, exit 0 (issue 60, item 2)."""
    chunk = log / "grads" / "c" / "1" / "0" / "0"
    if damage == "delete":
        chunk.unlink()
    elif damage == "flip":
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0x10
        chunk.write_bytes(bytes(data))
    else:
        shutil.copy(log / "grads" / "c" / "2" / "0" / "0", chunk)
    with pytest.raises(StoreError, match=r"grads of window 1, rows 0-5, (does not match its record|cannot be read)"):
        read_log(str(log))
    from classgrad.store.training_log.log_store import open_log_reader

    reader = open_log_reader(str(log))
    assert reader.read("grads", 0).shape == (run.C, run.DIM)  # the other windows read as before
    with pytest.raises(StoreError, match="window 1"):
        reader.read("grads", 1, slice(2, 4))


def test_a_deleted_lr_grads_chunk_and_a_lost_record_are_refused(log):
    (log / "lr_grads" / "c" / "0" / "0" / "0").unlink()
    with pytest.raises(StoreError, match=r"lr_grads of window 0, rows 0-5, does not match its record"):
        read_log(str(log))
    (log / "window_records" / "3.json").unlink()
    from classgrad.store.training_log.log_store import open_log_reader

    with pytest.raises(StoreError, match=r"window 3 is marked done but its record is missing"):
        open_log_reader(str(log)).read("count", 3)


@pytest.mark.parametrize("entry", [5.5, -1, True, 1])
def test_a_done_windows_entry_that_is_no_window_index_is_refused(log, entry):
    """Before: 5.5 counted window 5 twice (issue 60, item 2)."""
    _done(log, [0, 1, entry])
    with pytest.raises(StoreError, match=r"done_windows attribute holds .*not a window index"):
        read_log(str(log))


def test_a_truncated_array_metadata_file_is_one_line(log, capsys):
    """Before: an internal error and a traceback (issue 60, item 4)."""
    meta = log / "grads" / "zarr.json"
    meta.write_text(meta.read_text()[:100])
    with pytest.raises(StoreError, match=r"the metadata of 'grads' \(grads/zarr.json\) cannot be read"):
        read_log(str(log))
    model, _ = run.fresh()
    with pytest.raises(StoreError, match=r"grads/zarr.json"):
        GradLog(str(log), model, run.C, window=run.WINDOW, dim=run.DIM, start_step=8)
    assert cli_main(["similarity", str(log), "--window", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "grads/zarr.json" in err and "\n" not in err


def test_records_are_bound_to_their_window(log):
    """A record copied over another window's does not vouch for that window's chunks."""
    shutil.copy(log / "window_records" / "2.json", log / "window_records" / "1.json")
    with pytest.raises(StoreError, match="window 1 is marked done but its record is missing or damaged"):
        read_log(str(log))
    record = json.loads((log / "window_records" / "2.json").read_text())
    record["window"] = 1
    (log / "window_records" / "1.json").write_text(json.dumps(record))
    with pytest.raises(StoreError, match="grads of window 1, rows 0-5, does not match its record"):
        read_log(str(log))


def test_a_float64_model_logs_and_resumes(log):
    """Before: ``GradLog.step`` on a float64 model ended in a ValueError traceback (the rows'
    buffer was float32), then index_add_ refused the float64 rows (issue 60, item 4)."""
    import torch

    model, _ = run.fresh()
    model = model.double()
    opt = torch.optim.SGD(model.parameters(), lr=run.LR)
    with GradLog(str(log), model, run.C, window=run.WINDOW, dim=run.DIM, start_step=8) as logged:
        for step in (8, 9):
            x, y = run.batch(step)
            assert np.isfinite(logged.step(step, model, x.double(), y, opt))
    stored = read_log(str(log))
    assert stored["window"].tolist() == [0, 1, 2, 3, 4] and stored["grads"].dtype == np.float32
    assert np.abs(stored["grads"][4]).sum() > 0


def test_a_second_writer_is_refused_while_the_first_holds_the_log(log):
    """Before: two processes logging into one log both exited 0 and the log held windows of each
    (issue 60, item 3). The first writer holds the log's lease until it closes."""
    import torch

    from classgrad.errors import LeaseHeldError

    model, _ = run.fresh()
    first = GradLog(str(log), model, run.C, window=run.WINDOW, dim=run.DIM, start_step=8)
    with pytest.raises(LeaseHeldError, match=r"is in use by run 'gradlog-") as info:
        GradLog(str(log), model, run.C, window=run.WINDOW, dim=run.DIM, start_step=8)
    assert "\n" not in str(info.value)
    first.close()
    second = GradLog(str(log), model, run.C, window=run.WINDOW, dim=run.DIM, start_step=8)  # free now
    # The second's lease taken over by another run (its heartbeat stale): its next window is refused.
    lease_file = log.parent / "log.zarr.classgrad-lease.json"
    taken = json.loads(lease_file.read_text())
    taken.update(run_id="another-writer", pid=1)
    lease_file.write_text(json.dumps(taken))
    x, y = run.batch(8)
    rows = torch.zeros(len(torch.unique(y)), second.layout.dim)
    second.add(8, rows, torch.unique(y))
    second.add(9, rows, torch.unique(y))
    with pytest.raises(LeaseHeldError, match="lost its lease"):
        second.close()  # writes window 4: refused, not marked done
    assert read_log(str(log))["window"].tolist() == [0, 1, 2, 3]


def test_a_windows_chunk_files_are_the_bytes_zarr_writes(tmp_path):
    """A new log's windows are written straight as chunk files (zarr's pipeline wrote them at a
    tenth of numpy.save's speed): byte for byte what zarr writes for the same values, edge chunks
    (C = 300: rows 256-299 of 256) included."""
    from classgrad.store.training_log.log_store import LogSpec, open_log

    spec = LogSpec(num_classes=300, width=16, window=2, layout=[["w", [16]]], projection=None, model="M")
    rng = np.random.default_rng(0)
    values = (
        rng.standard_normal((300, 16)).astype(np.float32),
        rng.standard_normal((300, 16)).astype(np.float32),
        rng.integers(0, 5, 300),
        rng.standard_normal(300),
    )
    direct = open_log(str(tmp_path / "direct.zarr"), spec)
    direct.write_window(1, *values, (2, 4))
    by_zarr = open_log(str(tmp_path / "zarr.zarr"), spec)
    for name, value in zip(
        ("grads", "lr_grads", "count", "loss_sum", "steps"), (*values, np.array([2, 4])), strict=True
    ):
        array = by_zarr.group[name]
        array.resize((2, *array.shape[1:]))
        array[1] = value
    files = sorted(
        p.relative_to(tmp_path / "direct.zarr") for p in (tmp_path / "direct.zarr").rglob("c/*/**/*") if p.is_file()
    )
    assert len(files) == 2 * 2 + 3  # grads and lr_grads: two row chunks each; count, loss_sum, steps
    for rel in files:
        assert (tmp_path / "direct.zarr" / rel).read_bytes() == (tmp_path / "zarr.zarr" / rel).read_bytes(), rel


def test_a_bfloat16_log_holds_the_float32_sums_rounded_to_8_bits(tmp_path):
    """``GradLog(dtype="bfloat16")`` (issue 57, item 3): half the bytes; every stored sum is the
    float32 one rounded to nearest even at 8 significant bits (relative error <= 2**-8 each), read
    back as float32, checked against its record like a float32 log's; a resume with another dtype
    is refused naming it."""

    from classgrad.errors import StoreMismatchError

    def logged(url: str, dtype: str) -> dict:
        model, opt = run.fresh()
        with GradLog(url, model, run.C, window=run.WINDOW, dim=run.DIM, dtype=dtype) as glog:
            for step in range(4):
                x, y = run.batch(step)
                opt.zero_grad()
                glog.step(step, model, x, y, opt)
        return read_log(url)

    f32 = logged(str(tmp_path / "f32.zarr"), "float32")
    bf16 = logged(str(tmp_path / "bf16.zarr"), "bfloat16")
    for name in ("grads", "lr_grads"):
        a, b = f32[name], bf16[name]
        assert b.dtype == np.float32 and b.shape == a.shape
        # Round to nearest at 8 significant bits: each value within half a unit (2**-8) of its own.
        assert (np.abs(b - a) <= 2.0**-8 * np.abs(a)).all(), name
        assert (b != a).any()  # rounded, not float32 in disguise
    assert np.array_equal(f32["count"], bf16["count"]) and np.array_equal(f32["steps"], bf16["steps"])
    stored = sum(p.stat().st_size for p in (tmp_path / "bf16.zarr" / "grads" / "c").rglob("*") if p.is_file())
    full = sum(p.stat().st_size for p in (tmp_path / "f32.zarr" / "grads" / "c").rglob("*") if p.is_file())
    assert 2 * stored == full  # the chunks: half the bytes
    model, _ = run.fresh()
    with pytest.raises(StoreMismatchError, match=r"dtype: the log's \"bfloat16\", this run's \"float32\""):
        GradLog(str(tmp_path / "bf16.zarr"), model, run.C, window=run.WINDOW, dim=run.DIM, start_step=4)
    with pytest.raises(InputError, match="dtype must be one of float32, bfloat16"):
        GradLog(str(tmp_path / "f16.zarr"), model, run.C, window=run.WINDOW, dim=run.DIM, dtype="float16")
