"""``per_class_gradients`` on the models users bring: the first call and the best warm call, of
this checkout or of another one (to compare a change with the code before it, in one session).

For each model of ``benchmarks.real_model_cases`` (C classes of 1 to 4 samples), full rows and
the default projection at ``--dim``: the first call in this process and the best of ``--reps``
warm calls. ``--tree PATH`` runs the code of another checkout of this repository (e.g. a
``git worktree`` of the previous commit) through this virtual environment; alternate the two
(``--rounds``) so that both see the same machine.

    .venv/bin/python -m benchmarks.engine_times --classes 1000 --reps 6
    git worktree add /tmp/before HEAD~1
    .venv/bin/python -m benchmarks.engine_times --tree /tmp/before --rounds 2   # before, this, before, this

Prints seconds; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import tree_setup_code

ROOT = Path(__file__).resolve().parents[1]
MODELS = "bert,gpt2,vit,resnet,lstm,ln_mlp"


def measure(models: str, classes: int, dim: int, reps: int) -> dict[str, list[float]]:
    """``{model/rows: [first call s, best warm s]}`` in this process."""
    import torch

    from benchmarks.real_model_cases import build_case
    from classgrad import per_class_gradients

    torch.set_num_threads(2)
    out = {}
    for name in models.split(","):
        for projection in (None, {"dim": dim}):
            case = build_case(name, classes)
            kwargs = dict(num_classes=classes, progress=False, projection=projection)
            t0 = time.perf_counter()
            per_class_gradients(case.model, case.samples, **kwargs)
            first = time.perf_counter() - t0
            warm = []
            for _ in range(reps):
                t0 = time.perf_counter()
                per_class_gradients(case.model, case.samples, **kwargs)
                warm.append(time.perf_counter() - t0)
            out[f"{name}/{'projected' if projection else 'full'}"] = [first, min(warm)]
    return out


def in_tree(tree: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """``measure`` in a fresh process on the code of ``tree`` (the editable install's folders
    pointed at it before ``classgrad`` is imported)."""
    code = (
        "import json, sys\n"
        f"{tree_setup_code(str(tree))}"
        "from benchmarks.engine_times import measure\n"
        f"print(json.dumps(measure({args.models!r}, {args.classes}, {args.dim}, {args.reps})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tree", type=Path, help="another checkout to time against this one")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    trees = [args.tree.resolve(), ROOT] if args.tree else [ROOT]
    results: dict[str, list[dict[str, list[float]]]] = {str(t): [] for t in trees}
    for _ in range(args.rounds):
        for tree in trees:
            results[str(tree)].append(in_tree(tree, args))
    keys = list(next(iter(results.values()))[0])
    print("best warm s (first call s), per round")
    for key in keys:
        cells = [" ".join(f"{r[key][1]:.3f} ({r[key][0]:.3f})" for r in runs) for runs in results.values()]
        print(f"{key:22s} " + "  |  ".join(f"{Path(t).name}: {c}" for t, c in zip(results, cells)))


if __name__ == "__main__":
    main()
