"""Issue 49's GPU script keeps running as the code changes: its quick mode on the CPU, every
section, with no section or model raising and every check within its tolerance. GPU time is
scarce (a lent machine, minutes a session), so a script broken by a rename must fail here, not
there. The sections' subprocesses (``gpu_resnet18``, ``training_step``) are left out by a zero
budget: their own quick runs are the benchmarks' business, and they double this test's time."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_proof


def _run(monkeypatch: pytest.MonkeyPatch, out: Path, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["gpu_proof", "--device", "cpu", "--quick", "--out", str(out), *args])
    return gpu_proof.main()


def test_every_section_runs_on_the_cpu_and_finds_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    in_process = [name for name in gpu_proof.SECTIONS if name != "speed"]
    assert _run(monkeypatch, tmp_path / "a", "--sections", ",".join(in_process)) == 0
    assert _run(monkeypatch, tmp_path / "b", "--sections", "speed", "--budget-s", "0") == 0
    report = json.loads((tmp_path / "a" / "gpu_proof.json").read_text())
    assert report["exact"]["harness"] and not report["exact"]["beyond_tolerance"]
    speed = json.loads((tmp_path / "b" / "gpu_proof.json").read_text())["speed"]
    assert all("over_floor" in m for m in speed["models"].values()), speed["models"]
    assert "skipped" in speed["gpu_resnet18"]  # the zero budget


def test_what_needs_a_look_is_every_failure_and_nothing_else() -> None:
    report = {
        "exact": {"harness": [{"error": 1e-7, "ok": True}, {"error": 0.5, "ok": False}], "beyond_tolerance": [{}]},
        "speed": {"models": {"bert": {"error": "RuntimeError: boom\ntrace"}}, "sub": {"returncode": 2, "tail": "x"}},
        "headline": {"fp32": {"skipped": "budget"}},
    }
    found = gpu_proof.needs_a_look(report)
    assert [line.split(":")[0] for line in found] == ["exact/harness[1]", "speed/models/bert", "speed/sub"]
    assert "boom" in found[1] and "trace" not in found[1]


def test_the_time_limit_s_sigterm_keeps_what_the_section_had(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """scripts/gpu_proof.sh's timeout ends the run with SIGTERM: the section it cut is recorded
    with its results so far, no later section starts, and the report is written."""
    after = []

    def cut(args) -> dict:
        out = gpu_proof.live("cut", {"models": {"first": {"first_call_s": 1.0}}})
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises in here
        out["models"]["second"] = {}
        return out

    monkeypatch.setitem(gpu_proof.SECTIONS, "cut", cut)
    monkeypatch.setitem(gpu_proof.SECTIONS, "later", lambda args: after.append(1) or {})
    previous = signal.getsignal(signal.SIGTERM)
    assert _run(monkeypatch, tmp_path, "--sections", "env,cut,later") == 1
    assert signal.getsignal(signal.SIGTERM) == previous  # the run's handler is gone with the run
    report = json.loads((tmp_path / "gpu_proof.json").read_text())
    assert report["cut"]["models"] == {"first": {"first_call_s": 1.0}} and "time limit" in report["cut"]["error"]
    assert "later" not in report and not after
