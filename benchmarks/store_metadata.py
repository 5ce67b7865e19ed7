"""The store's metadata at 1,000,000 classes: ``status``, ``open_dataset`` and resume planning over
62,500 done shards, each in a fresh process (what a user waits for).

A store of ``--classes`` named rows of ``--dim`` columns in shards of ``--shard-rows`` rows is written
once through the store's own write path (rows, then each shard's record and done mark, as an
actor writes them; fsync off to build it quickly) under ``--dir`` and kept there for reruns.
Then, one fresh process each, timed from the parent (interpreter and imports included) and
inside (the operation alone):

- ``status``: ``classgrad status STORE`` as a user runs it;
- ``open_dataset``: ``classgrad.store.open_dataset`` and the ``shard_done`` variable's values;
- ``resume``: what a rerun's driver does before any actor starts: open the store, unmark done
  shards whose recorded chunks are gone (one listing, every record), the missing ranges;
- ``actor_open``: what each actor does at start-up: open the store for writing and take its
  first shard's class ids (and the size of the group's ``zarr.json`` it reads is printed).

``--tree PATH`` builds and times another checkout's code (the editable install pointed at it,
as ``engine_times.py --tree``): before and after a change on the same machine.

Targets (issue 55): ``status`` and ``open_dataset`` within 3 s, resume planning within 5 s; an
actor's open within 1 s (a goal of this benchmark: it must not grow with C).

``--sim-latency-ms 20``: the same three operations against a simulated object store with 20 ms
per request (``tests/support/simulated_object_store.py``: S3's requests, listings paged by 1,000
keys, requests concurrent as the client sends them), each child copying the store into it first
(not timed); the operation's own time and its requests are reported. Target: 30 s each.

    .venv/bin/python -m benchmarks.store_metadata --dir /tmp/store_metadata        # 1,000,000 classes
    .venv/bin/python -m benchmarks.store_metadata --dir /tmp/sm_quick --quick     # 100,000 classes
    .venv/bin/python -m benchmarks.store_metadata --dir /tmp/sm --sim-latency-ms 20   # against object storage's latency
    git worktree add /tmp/before 566e661    # then, the code before format 4 on the same machine:
    .venv/bin/python -m benchmarks.store_metadata --dir /tmp/sm --tree /tmp/before
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import print_table, print_targets, tree_setup_code, write_report

OUT = Path(__file__).resolve().parent / "out" / "store_metadata.json"
ROOT = Path(__file__).resolve().parents[1]
GOALS = {"status": 3.0, "open_dataset": 3.0, "resume": 5.0, "actor_open": 1.0}
OPERATIONS = ("status", "open_dataset", "resume", "actor_open")

_CHILD = {
    "status": """
from classgrad.service.commands.status import status_of
from classgrad.store import open_store
assert status_of(open_store(URL))["complete"]
""",
    "open_dataset": """
from classgrad.store import open_dataset
ds = open_dataset(URL)
flags = ds["shard_done"].values
assert flags.all(), "not every shard is done"
""",
    "actor_open": """
from classgrad.store import open_store
store = open_store(URL, mode="r+")  # as each actor opens it: the group's zarr.json, the arrays'
assert len(store.class_ids[:16]) == 16
""",
    "resume": """
from classgrad.store import open_store
store = open_store(URL)
done = store.unmark_damaged_shards()
assert done.all() and not store.missing_ranges(done)
""",
}


def build(url: str, classes: int, dim: int, shard_rows: int) -> float:
    import numpy as np

    from classgrad.store import StoreSpec, create_store

    t0 = time.perf_counter()
    # Named classes, as a job with a dataset's label names makes them (the group's metadata holds them).
    names = tuple(f"synset_{i:07d}" for i in range(classes))
    spec = StoreSpec(num_classes=classes, dim=dim, shard_rows=shard_rows, row_chunk=shard_rows, class_names=names)
    store = create_store(url, spec)
    store.durable = False  # building the fixture only: the timed reads do not depend on fsync
    rows = np.random.default_rng(0).standard_normal((classes, dim), dtype=np.float32)
    store.write_rows(0, rows, loss=np.zeros(classes), count=np.ones(classes, np.int64))
    for shard in range(store.num_shards):
        store.mark_shard_done(shard)
    return time.perf_counter() - t0


_SIM = """
from tests.support import simulated_object_store as sim
sim.load({local!r}, {url!r})
sim.SimulatedObjectStore.latency_s = {latency}
"""


def build_in(tree: str, url: str, classes: int, dim: int, shard_rows: int) -> float:
    call = f"build({url!r}, {classes}, {dim}, {shard_rows})"
    code = f"{tree_setup_code(tree)}from benchmarks.store_metadata import build\nprint({call})\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return float(done.stdout.strip().splitlines()[-1])


def timed_child(name: str, url: str, latency_ms: float | None = None, tree: str | None = None) -> dict:
    if name == "status" and latency_ms is None and tree is None:
        cmd = [sys.executable, "-m", "classgrad", "status", url]
    else:
        setup, target = "", url
        if latency_ms is not None:
            target = "simstore://bucket/store.zarr"
            setup = _SIM.format(local=url, url=target, latency=latency_ms / 1e3)
        code = (
            # classgrad imported before the clock: the operation alone (an actor has it imported)
            f"import json, time\n{tree_setup_code(tree)}import classgrad.store\n{setup}\nURL = {target!r}\n"
            "t0 = time.perf_counter()\n"
            f"{_CHILD[name]}\n"
            "print(time.perf_counter() - t0)\n"
        )
        if latency_ms is not None:
            code += "print(json.dumps(dict(sim.SimulatedObjectStore.requests)))\n"
        cmd = [sys.executable, "-c", code]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed: {proc.stderr[-2000:]}")
    lines = proc.stdout.strip().splitlines()
    if latency_ms is not None:
        return {"wall_s": wall, "inside_s": float(lines[-2]), "requests": json.loads(lines[-1])}
    return {"wall_s": wall, "inside_s": float(lines[-1]) if (name != "status" or tree) else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="where the store is built (kept for reruns)")
    parser.add_argument("--classes", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--shard-rows", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="100,000 classes")
    parser.add_argument("--sim-latency-ms", type=float, help="against a simulated object store with this latency")
    parser.add_argument("--tree", help="another checkout: build and time its code (the store in its own folder)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    if args.quick:
        args.classes = 100_000
    tag = "" if args.tree is None else "_" + Path(args.tree).name
    url = str(Path(args.dir) / f"c{args.classes}_d{args.dim}_s{args.shard_rows}{tag}.zarr")
    built = None
    if not Path(url).exists():
        print(f"building {url} ...", flush=True)
        if args.tree is None:
            built = build(url, args.classes, args.dim, args.shard_rows)
        else:
            built = build_in(args.tree, url, args.classes, args.dim, args.shard_rows)
        print(f"built in {built:.0f} s", flush=True)
    shards = -(-args.classes // args.shard_rows)
    if args.sim_latency_ms is not None:
        simulated(url, args, shards)
        return
    results = {name: timed_child(name, url, tree=args.tree) for name in OPERATIONS}
    group_json = (Path(url) / "zarr.json").stat().st_size
    print(f"\n== store metadata: {args.classes} classes, {shards} shards, each in a fresh process")
    print(f"the group's zarr.json, which every actor reads: {group_json / 1e6:.3f} MB")
    print_table(
        ["operation", "wall (fresh process)", "the operation alone", "goal"],
        [
            [
                name,
                f"{r['wall_s']:.2f} s",
                "-" if r["inside_s"] is None else f"{r['inside_s']:.2f} s",
                f"{GOALS[name]:.0f} s",
            ]
            for name, r in results.items()
        ],
    )
    targets = [
        {
            "name": f"{name} at {shards} shards",
            # an actor's open inside its process (the actor has imported classgrad and torch already)
            "value": r["inside_s"] if name == "actor_open" else r["wall_s"],
            "goal": f"<= {GOALS[name]:.0f} s",
            "met": (r["inside_s"] if name == "actor_open" else r["wall_s"]) <= GOALS[name],
        }
        for name, r in results.items()
    ]
    print_targets(targets)
    write_report(
        args.out,
        {
            "args": vars(args),
            "shards": shards,
            "built_s": built,
            "group_json_bytes": group_json,
            "results": results,
            "targets": targets,
        },
    )


def simulated(url: str, args: argparse.Namespace, shards: int) -> None:
    results = {name: timed_child(name, url, args.sim_latency_ms) for name in OPERATIONS}
    print(
        f"\n== store metadata against a simulated object store, {args.sim_latency_ms:g} ms a request: "
        f"{args.classes} classes, {shards} shards"
    )
    print_table(
        ["operation", "time (the operation alone)", "requests", "goal"],
        [[n, f"{r['inside_s']:.2f} s", json.dumps(r["requests"]), "30 s"] for n, r in results.items()],
    )
    targets = [
        {
            "name": f"{n} at {shards} shards, {args.sim_latency_ms:g} ms",
            "value": r["inside_s"],
            "goal": "<= 30 s",
            "met": r["inside_s"] <= 30,
        }
        for n, r in results.items()
    ]
    print_targets(targets)
    out = Path(args.out).with_name("store_metadata_sim.json")
    write_report(out, {"args": vars(args), "shards": shards, "results": results, "targets": targets})


if __name__ == "__main__":
    main()
