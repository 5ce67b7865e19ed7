"""Any benchmark module on this checkout and on another one, alternated in fresh processes: a
change's before and after timed round-robin on the same machine (load moves this VM's ratios by
up to 2x, so two separate runs are not comparable).

    git worktree add /tmp/before HEAD~1
    .venv/bin/python -m benchmarks.before_after --tree /tmp/before --rounds 2 -- \\
        benchmarks.training_log --model cnn --classes 10000 --parts --reps 3

Each round runs the module on ``--tree`` (through this venv: ``common.tree_setup_code``), then on
this checkout, each printing its own table under a heading. The benchmark modules themselves
are this checkout's; only classgrad's code changes. Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from benchmarks.common import tree_setup_code

ROOT = Path(__file__).resolve().parents[1]


def run_module(tree: Path | None, module: str, args: list[str]) -> int:
    """``python -m module args`` in a fresh process, on ``tree``'s classgrad (None: this one's)."""
    code = (
        f"{tree_setup_code(None if tree is None else str(tree))}"
        "import runpy, sys\n"
        f"sys.argv = {[module, *args]!r}\n"
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, required=True, help="the other checkout (the code before)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("module", help="a benchmark module, e.g. benchmarks.training_log")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    ns = parser.parse_args()
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    failed = 0
    for r in range(ns.rounds):
        for label, tree in (("before", ns.tree.resolve()), ("this checkout", None)):
            print(f"\n## round {r + 1}: {label} ({tree or ROOT})", flush=True)
            failed |= run_module(tree, ns.module, args) != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
