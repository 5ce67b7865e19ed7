"""The training log's integrity (issue 60, items 1, 2 and 4): no resume leaves a hole, `all`
never skips one, every chunk of a done window is checked against its window's record, and a
damaged log is refused in one line.

The log is ``tests/support/grad_log_run.py``'s: windows of 2 steps, rows sketched to 32 columns.
"""

from __future__ import annotations

import json
import shutil

import fsspec
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


@pytest.mark.parametrize("where", ["local", "object storage"])
def test_a_windows_files_are_the_bytes_zarr_writes_and_keep_only_the_rows_it_saw(tmp_path, where, monkeypatch):
    """A new log's windows are written straight as files (zarr's pipeline wrote them at a tenth
    of numpy.save's speed), locally and on object storage (fsspec's memory filesystem here): byte
    for byte what zarr writes for the same values. The sums are shards of one-row chunks holding
    only rows with a bit set (issue 57, item 3): a -0.0 or NaN row is stored, a zero row is not,
    a block of zero rows leaves no object (and a rewrite of the window removes the one there), an
    edge shard (C = 600: rows 512-599 of 256) has the full index. The log reads back the values
    bit for bit, through zarr and through the reader's own path, and the stored sums take the
    bytes of the rows kept."""
    from classgrad.store.training_log import row_shards
    from classgrad.store.training_log.log_store import LogSpec, open_log, open_log_reader
    from classgrad.store.training_log.row_shards import stored_rows

    local = where == "local"
    base = str(tmp_path) if local else f"memory://{tmp_path.name}"
    fs = fsspec.filesystem("file" if local else "memory")
    C, k = 600, 16
    spec = LogSpec(num_classes=C, width=k, window=2, layout=[["w", [k]]], projection=None, model="M")
    rng = np.random.default_rng(0)
    sums = rng.standard_normal((2, C, k)).astype(np.float32)
    sums[:, rng.random(C) < 0.7] = 0  # classes the window did not see
    sums[:, 256:512] = 0  # a whole shard of them: no object
    sums[0, 3] = -0.0  # equal to the fill value, not its bits: stored
    sums[1, 5, 2] = np.nan
    values = (sums[0], sums[1], rng.integers(0, 5, C), rng.standard_normal(C))
    shards = []  # the blocks the log's own writer made shards of (not zarr's pipeline)
    monkeypatch.setattr(row_shards, "stored_rows", lambda block: shards.append(block) or stored_rows(block))
    direct = open_log(f"{base}/direct.zarr", spec)
    direct.write_window(1, *(np.ones_like(v) for v in values), (2, 4))  # every row stored, then
    direct.write_window(1, *values, (2, 4))  # rewritten: shard 1's object goes
    direct.mark_done(1)
    assert len(shards) == 2 * 2 * 3  # two writes of grads and lr_grads, three shards each
    monkeypatch.undo()
    by_zarr = open_log(f"{base}/zarr.zarr", spec)
    for name, value in zip(
        ("grads", "lr_grads", "count", "loss_sum", "steps"), (*values, np.array([2, 4])), strict=True
    ):
        array = by_zarr.group[name]
        array.resize((2, *array.shape[1:]))
        array[1] = value
    roots = {kind: direct.loc.path.replace("direct.zarr", f"{kind}.zarr") for kind in ("direct", "zarr")}

    def chunk_objects(kind: str) -> dict[str, bytes]:
        found = [p for p in fs.find(roots[kind]) if "/c/" in p and not p.endswith(".partial")]
        return {p[len(roots[kind]) :]: fs.cat_file(p) for p in found}

    objects = chunk_objects("direct")
    assert len(objects) == 2 * 2 + 3  # grads and lr_grads: shards 0 and 2 each; count, loss_sum, steps
    assert objects == chunk_objects("zarr")
    kept = int((sums[0].view(np.uint32) != 0).any(axis=1).sum())
    index = 2 * (256 * 16 + 4)  # shards 0 and 2: an (offset, size) pair per row, and its crc32c
    assert sum(len(b) for key, b in objects.items() if key.startswith("/grads/")) == kept * k * 4 + index
    reader = open_log_reader(f"{base}/direct.zarr")
    for name, value in zip(("grads", "lr_grads"), values[:2], strict=True):
        assert reader._direct(reader.group[name], name, 1) is not None  # the reader's own path
        got = reader.read(name, 1)
        through_zarr = np.asarray(reader.group[name][1])
        assert got.view(np.uint32).tolist() == value.view(np.uint32).tolist() == through_zarr.view(np.uint32).tolist()
        rows = np.array([599, 3, 256, 5])
        assert reader.read(name, 1, rows).view(np.uint32).tolist() == value[rows].view(np.uint32).tolist()
    if not local:
        fs.rm(f"/{tmp_path.name}", recursive=True)


def test_a_log_of_dense_chunks_made_before_keeps_them_when_reopened(tmp_path):
    """A log made before the row shards (dense plain chunks of 256 rows) is reopened, written and
    read in its own layout: its windows' chunk files are zarr's bytes, and read back equal."""
    from classgrad.store.training_log.log_store import LogSpec, open_log, open_log_reader

    spec = LogSpec(num_classes=300, width=8, window=1, layout=[["w", [8]]], projection=None, model="M")
    url = str(tmp_path / "old.zarr")
    group = open_log(url, spec).group
    for name in ("grads", "lr_grads"):  # the layout logs had before
        group.create_array(
            name, shape=(0, 300, 8), chunks=(1, 256, 8), dtype="float32", fill_value=0, compressors=None,
            dimension_names=("window", "class_id", "column"), overwrite=True,
        )  # fmt: skip
    rng = np.random.default_rng(3)
    sums = rng.standard_normal((300, 8)).astype(np.float32)
    sums[rng.random(300) < 0.5] = 0
    log = open_log(url, spec)  # reopened
    log.write_window(0, sums, 2 * sums, np.ones(300, np.int64), np.zeros(300), (0, 1))
    log.mark_done(0)
    assert zarr.open_array(url + "/grads", mode="r").shards is None
    chunk = tmp_path / "old.zarr" / "grads" / "c" / "0" / "0" / "0"
    assert chunk.stat().st_size == 256 * 8 * 4  # a dense chunk, its zero rows in it
    reader = open_log_reader(url)
    assert reader._direct(reader.group["grads"], "grads", 0) is None  # through zarr
    assert np.array_equal(reader.read("grads", 0), sums) and np.array_equal(reader.read("lr_grads", 0), 2 * sums)


def test_a_zstd_log_holds_dense_compressed_chunks_and_the_same_windows(tmp_path):
    """``GradLog(codec="zstd")``: dense chunks of 256 rows, compressed (what zarr's own pipeline
    reads fastest), holding the same windows as the default's row shards; another codec is
    refused in one line."""

    shards, dense = logged(str(tmp_path / "s.zarr"), codec="none"), logged(str(tmp_path / "z.zarr"), codec="zstd")
    grads = zarr.open_array(str(tmp_path / "z.zarr" / "grads"), mode="r")
    assert grads.shards is None and [type(c).__name__ for c in grads.compressors] == ["ZstdCodec"]
    assert zarr.open_array(str(tmp_path / "s.zarr" / "grads"), mode="r").shards is not None
    assert shards.keys() == dense.keys() and all(np.array_equal(shards[k], dense[k]) for k in shards)
    model, _ = run.fresh()
    with pytest.raises(InputError, match="codec must be one of none, zstd, got 'lz4'"):
        GradLog(str(tmp_path / "x.zarr"), model, run.C, window=run.WINDOW, dim=run.DIM, codec="lz4")


@pytest.mark.parametrize("where", ["local", "object storage"])
def test_a_damaged_shard_is_one_line_naming_the_rows(tmp_path, where):
    """On the reader's own path, locally and on object storage (fsspec's memory filesystem): a
    shard whose index fails its crc32c, or cut short, cannot be read; one with a stored row's
    byte flipped, or deleted (its rows then read as zeros), does not match the window's record.
    Each is one line naming the log, the array, the window and the rows."""
    from classgrad.store.training_log.log_store import LogSpec, open_log, open_log_reader

    local = where == "local"
    url = str(tmp_path / "log.zarr") if local else f"memory://{tmp_path.name}/log.zarr"
    fs = fsspec.filesystem("file" if local else "memory")
    spec = LogSpec(num_classes=300, width=8, window=1, layout=[["w", [8]]], projection=None, model="M")
    log = open_log(url, spec)
    sums = np.ones((300, 8), np.float32)
    sums[::2] = 0  # half the rows stored
    log.write_window(0, sums, sums, np.ones(300, np.int64), np.zeros(300), (0, 1))
    log.mark_done(0)
    shard = f"{log.loc.path}/grads/c/0/1/0"
    good = fs.cat_file(shard)
    rows = "grads of window 0, rows 256-299"
    damage = {
        "index bit": (good[:-10] + bytes([good[-10] ^ 1]) + good[-9:], "cannot be read \\(ValueError: .*crc32c"),
        "cut short": (good[:100], "cannot be read \\(ValueError: .*shorter than its index"),
        "row bit": (bytes([good[0] ^ 1]) + good[1:], "does not match its record"),
        "deleted": (None, "does not match its record"),
    }
    for what, (blob, message) in damage.items():
        if blob is None:
            fs.rm_file(shard)
        else:
            fs.pipe_file(shard, blob)
        with pytest.raises(StoreError, match=f"{rows}, {message}") as err:
            open_log_reader(url).read("grads", 0)
        assert "\n" not in str(err.value), what
    if not local:
        fs.rm(f"/{tmp_path.name}", recursive=True)


def test_only_the_log_layout_of_row_shards_is_read_straight(tmp_path):
    """The direct paths take only shards of one window's block of whole rows with one-row
    chunks; zarr reads anything else (a shard of two windows, of two rows' widths, a 2-D array)."""
    from classgrad.store.training_log.row_shards import is_row_sharded

    group = zarr.open_group(str(tmp_path / "g.zarr"), mode="w", zarr_format=3)

    def made(name: str, shape: tuple, chunks: tuple, shards: tuple | None) -> zarr.Array:
        return group.create_array(name, shape=shape, chunks=chunks, shards=shards, dtype="float32", compressors=None)

    assert is_row_sharded(made("log", (2, 512, 8), (1, 1, 8), (1, 256, 8)))
    assert not is_row_sharded(made("two_windows", (2, 512, 8), (1, 1, 8), (2, 256, 8)))
    assert not is_row_sharded(made("half_rows", (2, 512, 16), (1, 1, 8), (1, 256, 16)))
    assert not is_row_sharded(made("dense", (2, 512, 8), (1, 256, 8), None))
    assert not is_row_sharded(made("flat", (2, 512), (1, 1), (1, 256)))


def logged(url: str, **options) -> dict:
    """Four steps of ``run``'s model by ``GradLog.step`` into a log made with ``options``, read back."""
    model, opt = run.fresh()
    with GradLog(url, model, run.C, window=run.WINDOW, dim=run.DIM, **options) as glog:
        for step in range(4):
            x, y = run.batch(step)
            opt.zero_grad()
            glog.step(step, model, x, y, opt)
    return read_log(url)


def test_a_bfloat16_log_holds_the_float32_sums_rounded_to_8_bits(tmp_path):
    """``GradLog(dtype="bfloat16")`` (issue 57, item 3): half the bytes; every stored sum is the
    float32 one rounded to nearest even at 8 significant bits (relative error <= 2**-8 each), read
    back as float32, checked against its record like a float32 log's; a resume with another dtype
    is refused naming it."""

    from classgrad.errors import StoreMismatchError

    f32 = logged(str(tmp_path / "f32.zarr"), dtype="float32")
    bf16 = logged(str(tmp_path / "bf16.zarr"), dtype="bfloat16")
    for name in ("grads", "lr_grads"):
        a, b = f32[name], bf16[name]
        assert b.dtype == np.float32 and b.shape == a.shape
        # Round to nearest at 8 significant bits: each value within half a unit (2**-8) of its own.
        assert (np.abs(b - a) <= 2.0**-8 * np.abs(a)).all(), name
        assert (b != a).any()  # rounded, not float32 in disguise
    assert np.array_equal(f32["count"], bf16["count"]) and np.array_equal(f32["steps"], bf16["steps"])
    # The rows stored: half the bytes (each shard also holds an index of the same size in both).
    shards = list((tmp_path / "bf16.zarr" / "grads" / "c").rglob("*"))
    index = sum(p.is_file() for p in shards) * (min(run.C, 256) * 16 + 4)
    stored = sum(p.stat().st_size for p in shards if p.is_file()) - index
    full = sum(p.stat().st_size for p in (tmp_path / "f32.zarr" / "grads" / "c").rglob("*") if p.is_file()) - index
    assert 2 * stored == full > 0
    model, _ = run.fresh()
    with pytest.raises(StoreMismatchError, match=r"dtype: the log's \"bfloat16\", this run's \"float32\""):
        GradLog(str(tmp_path / "bf16.zarr"), model, run.C, window=run.WINDOW, dim=run.DIM, start_step=4)
    with pytest.raises(InputError, match="dtype must be one of float32, bfloat16"):
        GradLog(str(tmp_path / "f16.zarr"), model, run.C, window=run.WINDOW, dim=run.DIM, dtype="float16")
