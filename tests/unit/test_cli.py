"""``classgrad.service.commands.cli``: the command line's own behaviour, apart from any command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from classgrad.service.commands.cli import main
from classgrad.store import open_store
from tests.support.stores import synthetic_store


def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path):
    """`classgrad inspect STORE --top 2000 | head -1` once ended in a BrokenPipeError traceback."""
    synthetic_store(tmp_path / "s", num_classes=2000, dim=8)
    proc = subprocess.Popen(
        [sys.executable, "-m", "classgrad", "inspect", str(tmp_path / "s"), "--top", "2000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()  # what `head -1` reads, then it goes away
    proc.stdout.close()
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=120)
    assert first, err
    assert code == 141 and "Traceback" not in err and "BrokenPipe" not in err, (code, err)


def test_an_option_its_command_does_not_know_is_refused_by_that_command(tmp_path, capsys):
    """argparse's own refusal showed the top-level usage for a subcommand's mistyped option."""
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(tmp_path / "s"), "--topp", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("usage: classgrad inspect ")
    assert err.strip().splitlines()[-1] == "classgrad inspect: error: unrecognized arguments: --topp 3"
    with pytest.raises(SystemExit):
        main(["jobs", "status", "raysubmit_1", "--bogus"])  # a command's own subcommand
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "classgrad jobs status: error: unrecognized arguments: --bogus"
    )


def test_status_after_a_rerun_with_nothing_left_names_the_run_that_computed_the_rows(tmp_path, capsys):
    synthetic_store(tmp_path / "s", num_classes=40, dim=8)
    store = open_store(str(tmp_path / "s"), mode="r+")
    timing = {"seconds": 3.0, "startup_s": 1.0, "compute_s": 2.0}
    shards = {"shards_total": 4}
    store.append_run({"run_id": "r1", "status": "complete", "rows": 40, "rows_per_s": 20.0, **timing, **shards,
                      "shards_skipped": 0, "engine_notes": ["partitioned: hooks for all 4 params"]})  # fmt: skip
    store.append_run({"run_id": "r2", "status": "complete", "rows": 0, "rows_per_s": 0.0, **timing, **shards,
                      "shards_skipped": 4})  # fmt: skip
    assert main(["status", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "last run  r2: complete, nothing left to compute, 0 retries (of 2 runs)" in out
    assert "rows by   r1: complete, 40 rows in 2.0 s of compute (20.0 rows/s)" in out
    assert "engine: partitioned: hooks for all 4 params" in out
    # A run that failed before computing a row had work left: it is shown as it was.
    store.append_run({"run_id": "r3", "status": "failed", "rows": 0, **timing, **shards, "shards_skipped": 2,
                      "error": "StoreError: the disk is full"})  # fmt: skip
    assert main(["status", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "last run  r3: failed, 0 rows in 2.0 s of compute" in out and "error: StoreError: the disk is full" in out
    assert "rows by" not in out
