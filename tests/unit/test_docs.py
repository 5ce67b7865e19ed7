"""The README says what the code does: its config reference is generated from the code, its
two commands are the ones CI runs, and every config in configs/ loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from classgrad.config import load_config
from classgrad.service.commands.cli import COMMANDS, build_parser
from tests.support.docs import python_blocks

REPO = Path(__file__).resolve().parents[2]


def test_config_reference_in_readme_is_current():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "config_reference.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    readme = (REPO / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == ["make demo", "make test"]
    assert "exec make test" in (REPO / ".ci" / "run").read_text()
    # CI's test command includes the lint and type checks, so they cannot drift into failing.
    assert "test: setup lint\n" in (REPO / "Makefile").read_text()
    lint = (REPO / "Makefile").read_text().split("lint: setup\n", 1)[1].split("\n\n", 1)[0]
    for check in (".venv/bin/ruff check .", ".venv/bin/ruff format --check .", "$(PY) scripts/typecheck.py"):
        assert f"\t{check}\n" in lint + "\n", check
    makefile = (REPO / "Makefile").read_text()
    assert "demo: setup\n\t.venv/bin/classgrad run configs/demo.yaml" in makefile


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_loads(path):
    load_config(path)


def test_every_command_is_in_the_readme_and_has_help():
    readme = (REPO / "README.md").read_text()
    parser = build_parser()
    for name in COMMANDS:
        assert f"`classgrad {name}" in readme, f"README does not mention classgrad {name}"
    assert parser.format_help()


def test_the_hugging_face_page_runs():
    """Every Python snippet of docs/huggingface.md, in order, in one namespace."""
    import torch

    text = (REPO / "docs" / "huggingface.md").read_text()
    blocks = python_blocks(text)
    assert blocks, "docs/huggingface.md has no Python snippet"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/huggingface.md", "exec"), namespace)  # noqa: S102 - our own docs
    C = namespace["C"]
    assert namespace["G"].shape == namespace["G16"].shape and namespace["G"].shape[0] == C
    assert bool(torch.isfinite(namespace["G16"]).all())
    # The GPT-2 recipe: padded batches give the unpadded rows, up to the order of float32 sums
    # over other batch compositions (the engine contract for fp32 rows is 1e-6 relative; 1e-5
    # for transformer rows, as in tests/unit/test_model_io.py).
    padded, one = namespace["G_gpt"], namespace["G_one"]
    assert float((padded - one).norm() / one.norm()) <= 1e-5
