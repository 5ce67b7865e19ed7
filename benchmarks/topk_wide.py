"""Top-k-only similarity on a wide store (many more columns than rows: issue 29's aspect, 5,000 x
155,912 there, scaled down here): each task's peak memory against the plan's bound, the passes
over the store and the time, for every task of one run; the figures also go to
``benchmarks/out/topk_wide.json``.

Every task runs, one after another, in one fresh process per route (as a Ray worker runs them),
``torch`` imported before any meter starts, the store opened before (``topk_task`` meters from
before it opens the store; here the reads and the arithmetic alone are metered, as in the issue).
``--module PATH`` loads another ``similarity_topk.py`` in place of the installed one (the route
before issue 29: ``git show 7da136d:service/analysis/similarity_topk.py > /tmp/old_topk.py``).
Timing on a shared machine is noisy: compare routes run one after the other, and the CPU seconds.

    .venv/bin/python -m benchmarks.topk_wide --classes 600 --dim 40000 --task-mb 64 [--col-chunk 4000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = """
import importlib.util, json, sys, time
import torch  # noqa: F401 - imported before any meter starts, as topk_task does
from classgrad.service.analysis.memory import PeakMemory
from classgrad.store import open_store
module, url, plan = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if module:
    spec = importlib.util.spec_from_file_location("other_topk", module)
    mod = importlib.util.module_from_spec(spec); sys.modules["other_topk"] = mod; spec.loader.exec_module(mod)
else:
    from classgrad.service.analysis import similarity_topk as mod
p = mod.TopKPlan(**plan)
store = open_store(url)
peaks, read, t0, c0 = [], 0, time.perf_counter(), time.process_time()
for a, b in p.blocks():
    meter = PeakMemory()
    read += mod.streamed_topk(store.block, p, a, b)[2]
    peaks.append(meter.close() - meter.start)
print(json.dumps({"peaks": peaks, "read": read, "seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                  "bound": p.memory_bound()["total"], "rows": p.block_rows, "bands": len(p.bands())}))
"""


def _load(path: str | None):
    if not path:
        from classgrad.service.analysis import similarity_topk

        return similarity_topk
    import importlib.util

    spec = importlib.util.spec_from_file_location("other_topk", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["other_topk"] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=600)
    parser.add_argument("--dim", type=int, default=40_000)
    parser.add_argument("--task-mb", type=float, default=64.0)
    parser.add_argument("--col-chunk", type=int, default=1 << 20, help="the store's column chunk (default: whole rows)")
    parser.add_argument("--module", default=None, help="another similarity_topk.py to measure in place of ours")
    parser.add_argument("--quick", action="store_true", help="160 classes x 8,000 columns, 40 MiB per task")
    args = parser.parse_args(argv)
    if args.quick:
        args.classes, args.dim, args.task_mb = 160, 8_000, 40.0
    sys.path.insert(0, str(REPO))
    from classgrad.service.analysis.similarity import SimilarityConfig
    from tests.support.stores import synthetic_store

    C, D = args.classes, args.dim
    url = str(Path(tempfile.mkdtemp(prefix="topk-wide-")) / "wide.zarr")
    store, _ = synthetic_store(url, num_classes=C, dim=D, col_chunk=args.col_chunk, shard_rows=64)
    mod = _load(args.module)
    plan = mod.plan_topk(store, SimilarityConfig(dense=False, top_k=10, task_mb=args.task_mb))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, args.module or "", url, json.dumps(asdict(plan))],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
        cwd=REPO,
    )
    r = json.loads(out.stdout.splitlines()[-1])
    result = {"classes": C, "dim": D, "task_mb": args.task_mb, "col_chunk": args.col_chunk, "module": args.module, **r}
    (REPO / "benchmarks" / "out").mkdir(parents=True, exist_ok=True)
    (REPO / "benchmarks" / "out" / "topk_wide.json").write_text(json.dumps(result, indent=2))
    print(
        f"{C} x {D} (column chunks of {min(args.col_chunk, D)}), --task-mb {args.task_mb:g}: "
        f"{len(r['peaks'])} tasks of {r['rows']} rows in {r['bands']} band(s); peak per task "
        f"+{max(r['peaks']) / 2**20:.1f} MiB (bound {r['bound'] / 2**20:.1f} MiB); read "
        f"{r['read'] / 2**30:.2f} GiB = {r['read'] / (C * D * 4):.0f} passes; {r['seconds']:.1f} s wall, "
        f"{r['cpu']:.1f} s CPU"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
