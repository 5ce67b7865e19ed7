"""The run summary: start-up and compute reported apart, the rate over compute alone, and the
engine's notes kept short (issue 17)."""

from __future__ import annotations

import pytest

from classgrad.service.driver_runtime.driver import MAX_ENGINE_NOTES, RunSummary


def test_rate_is_over_compute_and_startup_is_reported_apart():
    summary = RunSummary(run_id="r1", status="complete", rows=300)
    summary.finish(26.2, ready_after_s=24.6)
    data = summary.to_dict()
    # Float subtraction: 26.2 - 24.6 is 1.6 to within rounding.
    assert data["startup_s"] == 24.6 and data["compute_s"] == pytest.approx(1.6, abs=1e-9)
    assert data["seconds"] == 26.2
    # 300 rows over 1.6 s of compute, not over the 26.2 s the whole run took.
    assert data["rows_per_s"] == pytest.approx(187.5, rel=1e-9)
    text = "\n".join(summary.lines())
    assert "300 in 1.6 s of compute (187.5 rows/s)" in text
    assert "start-up    24.6 s" in text and "26.2 s in all" in text


def test_a_run_whose_actors_never_started_is_all_startup():
    summary = RunSummary(run_id="r2", status="failed", rows=0)
    summary.finish(3.0, ready_after_s=None)
    assert (summary.startup_s, summary.compute_s, summary.rows_per_s) == (3.0, 0.0, 0.0)


def test_engine_notes_are_deduped_short_and_few_and_printed():
    summary = RunSummary(run_id="r3")
    summary.add_engine_notes(["dense block_rows=8 chosen", "torch.func.vjp unavailable\nsecond line"])
    summary.add_engine_notes(["dense block_rows=8 chosen", "x" * 1000])  # a second actor says the same
    summary.add_engine_notes([f"note {i}" for i in range(20)])
    notes = summary.to_dict()["engine_notes"]
    assert notes[:2] == ["dense block_rows=8 chosen", "torch.func.vjp unavailable"]
    assert len(notes) == MAX_ENGINE_NOTES and all(len(n) <= 200 for n in notes)
    text = "\n".join(summary.lines())
    assert "dense block_rows=8 chosen" in text and "second line" not in text


def test_a_note_each_actor_reports_with_its_own_figures_is_shown_once():
    # Issue 29: every actor measured the image format and reported its own seconds per sample.
    summary = RunSummary(run_id="r3")
    for seconds in ("1.21e-03", "9.80e-04", "1.05e-03"):
        summary.add_engine_notes(
            [f"partitioned: image inputs channels_last (seconds per sample: {{'contiguous': '{seconds}'}})"]
        )
    summary.add_engine_notes(["partitioned: image inputs contiguous (seconds per sample: {'contiguous': '2e-3'})"])
    assert [n.split(" (")[0] for n in summary.engine_notes] == [
        "partitioned: image inputs channels_last",
        "partitioned: image inputs contiguous",
    ]
    assert sum("image inputs" in line for line in summary.lines()) == 2
