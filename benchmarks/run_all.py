"""Run every benchmark script in ``benchmarks/``, in quick mode unless ``--full``.

Every ``benchmarks/*.py`` with a ``__main__`` block is a benchmark (``common.py`` and ``before_after.py`` are helpers).
Each runs as ``python -m benchmarks.NAME`` in its own process (one after another: they time
things, so they must not share the cores), prints its own tables and writes its JSON under
``benchmarks/out/``. This script prints a summary (exit status and minutes of each) and writes
``benchmarks/out/run_all.json``. ``gpu_resnet18.py`` runs on CUDA when a GPU is present and as
a CPU smoke test (``--device cpu``) otherwise.

    .venv/bin/python -m benchmarks.run_all                   # everything, quick (what `make bench` runs)
    .venv/bin/python -m benchmarks.run_all --full            # the full sizes (much longer)
    .venv/bin/python -m benchmarks.run_all --only alternatives,engine_memory

Run from the repository root (where ``python -m`` finds the ``benchmarks`` package).

Exit status: non-zero if any script failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out" / "run_all.json"
# Helpers, not benchmarks (before_after runs one on two checkouts).
NOT_BENCHMARKS = {"run_all.py", "common.py", "before_after.py"}
# Order: the engine comparisons first; anything else found in benchmarks/ runs after these.
FIRST = ["alternatives", "engine_memory", "end_to_end", "store_write", "projection", "similarity", "gpu_resnet18"]


def discover() -> list[str]:
    """Every benchmark script in ``benchmarks/`` (a ``.py`` with a ``__main__`` block)."""
    found = sorted(
        p.stem
        for p in HERE.glob("*.py")
        if p.name not in NOT_BENCHMARKS and not p.name.startswith("_") and "__main__" in p.read_text()
    )
    return [n for n in FIRST if n in found] + [n for n in found if n not in FIRST]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="full sizes instead of --quick")
    parser.add_argument("--quick", action="store_true", help="quick mode (the default; for symmetry)")
    parser.add_argument("--only", help="comma-separated subset of the scripts (names without .py)")
    args = parser.parse_args()
    available = discover()
    names = args.only.split(",") if args.only else available
    unknown = [n for n in names if n not in available]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown} (choices: {', '.join(available)})")
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    results = []
    for name in names:
        script = HERE / f"{name}.py"
        quick = not args.full and "--quick" in script.read_text()
        cmd = [sys.executable, "-m", f"benchmarks.{name}"] + (["--quick"] if quick else [])
        if name == "gpu_resnet18" and not has_cuda:
            cmd += ["--device", "cpu"]
        print(f"\n== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd).returncode
        minutes = (time.perf_counter() - t0) / 60
        results.append({"name": name, "cmd": cmd[1:], "returncode": rc, "minutes": round(minutes, 2)})
    print("\n== run_all summary")
    for r in results:
        status = "ok" if r["returncode"] == 0 else f"FAILED (exit {r['returncode']})"
        print(f"{r['name']:<16} {status:<20} {r['minutes']:6.1f} min")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"full": args.full, "results": results}, indent=1))
    print(f"wrote {OUT}")
    sys.exit(1 if any(r["returncode"] != 0 for r in results) else 0)


if __name__ == "__main__":
    main()
