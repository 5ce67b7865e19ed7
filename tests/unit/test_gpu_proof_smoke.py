"""Issue 49's GPU script keeps running as the code changes: its quick mode on the CPU, every
section, with no section or model raising and every check within its tolerance. GPU time is
scarce (a lent machine, minutes a session), so a script broken by a rename must fail here, not
there. The sections' subprocesses (``gpu_resnet18``, ``training_step``) are left out by a zero
budget: their own quick runs are the benchmarks' business, and they double this test's time."""

from __future__ import annotations

import json
import sys
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
