"""The engines now against the engines of an earlier revision, same cases, same run.

The baseline's ``workers/engines/partitioned.py`` and ``dense.py`` are read from git
(``--baseline``, default e1a046b: the engines before issue 6's work) and loaded next to the
current ones; both are built fresh for every timed run (the dense engine measures its block
size in that run), on the benchmark cases of ``alternatives.py``. Rows are checked equal
(``allclose``). Timed round-robin, best of ``--reps`` after a warm-up, process CPU time with
one torch thread (see ``common.set_clock``).

    .venv/bin/python -m benchmarks.engine_speedup
    .venv/bin/python -m benchmarks.engine_speedup --quick

Prints a table and writes ``benchmarks/out/engine_speedup.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import common
from benchmarks.common import Case, fmt_s, make_case, print_table
from classgrad.workers.amp import PrecisionPolicy
from classgrad.workers.layout import ParamLayout
from classgrad.workers.probe import ProbeSet

ROOT = Path(__file__).resolve().parents[1]
OUT = common.OUT_DIR / "engine_speedup.json"


def load_baseline(rev: str, tmp: Path) -> dict[str, type]:
    classes = {}
    for name, cls in (("dense", "DenseEngine"), ("partitioned", "PartitionedEngine")):
        src = subprocess.run(
            ["git", "show", f"{rev}:workers/engines/{name}.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        path = tmp / f"baseline_{name}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
        module = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        spec.loader.exec_module(module)
        classes[name] = getattr(module, cls)
    return classes


def baseline_run(case: Case, cls: type, holder: dict):
    """The baseline engine, built fresh each run, all rows kept (``common.classgrad`` for now's)."""

    def run() -> None:
        eng = cls(
            case.model,
            ProbeSet((case.x, case.y), batch_size=case.batch_size),
            case.loss,
            ParamLayout.from_model(case.model),
            precision=PrecisionPolicy(case.precision),
        )
        holder["blocks"] = [b.rows for b in eng.iter_blocks(range(case.num_classes))]
        holder["classes"] = list(range(case.num_classes))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer cases, 3 repetitions")
    parser.add_argument("--baseline", default="e1a046b", help="git revision of the baseline engines")
    parser.add_argument("--reps", type=int, help="repetitions (default 5, quick 3)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 5)
    torch.set_num_threads(1)
    clock = common.set_clock("auto")
    cases = [
        ("partitioned", dict(model="cnn", num_classes=256, samples_per_class=8)),
        ("partitioned", dict(model="mlp", num_classes=256, samples_per_class=8)),
        ("partitioned", dict(model="mlp", num_classes=1000, samples_per_class=4, tiny=True)),
        ("dense", dict(model="mlp", num_classes=256, samples_per_class=8, loss="logit", max_samples=256)),
        ("dense", dict(model="cnn", num_classes=128, samples_per_class=8, loss="logit", max_samples=256)),
    ]
    if not args.quick:
        cases += [
            ("partitioned", dict(model="cnn", num_classes=1000, samples_per_class=4, tiny=True)),
            ("dense", dict(model="mlp", num_classes=256, samples_per_class=8, loss="logit", max_samples=512)),
        ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        baseline = load_baseline(args.baseline, Path(tmp))
        for kind, kw in cases:
            case = make_case(**kw)
            old, new = {}, {}
            t = common.interleaved(
                {"baseline": baseline_run(case, baseline[kind], old), "now": common.classgrad(case, new, kind)}, reps
            )
            ok, err = common.compare(
                common.held_rows(new), new["classes"], common.held_rows(old), old["classes"], "fp32"
            )
            rows.append(
                {
                    "engine": kind,
                    "case": case.name,
                    "dim": case.dim,
                    "baseline_s": t["baseline"].best,
                    "now_s": t["now"].best,
                    "speedup": t["baseline"].best / t["now"].best,
                    "rows_equal": ok,
                    "max_rel_err": err,
                }
            )
            print(
                f"{kind:<12} {case.name:<32} baseline {fmt_s(t['baseline'].best):>9}  now {fmt_s(t['now'].best):>9}"
                f"  {rows[-1]['speedup']:.2f}x  rows equal: {ok}",
                flush=True,
            )
    print(f"\n== engines now vs {args.baseline} ({clock} time, best of {reps})")
    print_table(
        ["engine", "case", "D", "baseline", "now", "speed-up", "rows equal"],
        [
            [
                r["engine"],
                r["case"],
                f"{r['dim']:,}",
                fmt_s(r["baseline_s"]),
                fmt_s(r["now_s"]),
                f"{r['speedup']:.2f}x",
                "yes" if r["rows_equal"] else f"NO ({r['max_rel_err']:.1e})",
            ]
            for r in rows
        ],
    )
    report: dict[str, Any] = {"machine": common.machine_info(), "args": vars(args), "clock": clock, "results": rows}
    common.write_report(args.out, report)


if __name__ == "__main__":
    main()
