"""An actor's measured peak resident memory beside the preflight's estimate of it, without Ray.

Holds ``estimate_and_measure``: for each job config (a dict), in one fresh Python (the zygote:
torch and classgrad's worker modules imported, no tensor work done yet) forked once per job, the
driver's ``check_job`` and store creation run in one child (its preflight footprint, taken as a real
driver takes it: its own build measured), and the real ``GradientWorker`` computes every shard in
a second child, whose peak is the kernel's high-water mark (``VmHWM``: a forked child starts from
the zygote's resident pages, as a fresh actor process starts from its imports; the zygote also
imports transformers once, see ``main``). Two children at a
time (each peak is its own process's). Linux only (fork, ``/proc``).

Run as ``python -m tests.support.peak_memory JOBS.json``: prints one JSON line per job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def estimate_and_measure(jobs: list[dict], timeout: float = 300) -> list[dict[str, Any]]:
    """Per job: ``{"estimate": Footprint.to_dict(), "peak_rss_bytes": ..., "preloaded_bytes": ...,
    "notes": [...]}`` (``preloaded_bytes``: what the zygote's import of transformers added to every
    child, which no estimate here counts)."""
    path = Path(jobs[0]["store"]["url"]).parent / "peak_memory_jobs.json"
    path.write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.peak_memory", str(path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"peak_memory failed: {proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _start(fn) -> tuple[int, int]:
    """Fork a child that runs ``fn()`` and writes its JSON-able result to a pipe: (pid, read end)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        code = 0
        try:
            payload = {"ok": fn()}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            payload, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
        with os.fdopen(write, "w") as fh:
            fh.write(json.dumps(payload))
        os._exit(code)
    os.close(write)
    return pid, read


def _finish(child: tuple[int, int]) -> Any:
    pid, read = child
    with os.fdopen(read) as fh:
        data = json.loads(fh.read() or '{"error": "no answer"}')
    os.waitpid(pid, 0)
    if "error" in data:
        raise RuntimeError(data["error"])
    return data["ok"]


def _in_children(fns: list, at_once: int = 2) -> list[Any]:
    """Each of ``fns`` in its own forked child, ``at_once`` at a time (each child's peak is its own)."""
    results: list[Any] = []
    for i in range(0, len(fns), at_once):
        children = [_start(fn) for fn in fns[i : i + at_once]]
        results += [_finish(child) for child in children]
    return results


def _driver(job: dict) -> dict:
    from classgrad.config import JobConfig
    from classgrad.service.driver_runtime.preparation import check_job, prepare_store

    config = JobConfig.model_validate(job)
    checked = check_job(config)
    prepared = prepare_store(config, checked=checked)
    return {"footprint": checked.footprint, "shards": [s.index for s in prepared.shards]}


def _actor(job: dict, shards: list[int]) -> dict:
    from classgrad.workers.actor_runtime.actor import GradientWorker, peak_memory

    worker = GradientWorker(job, num_threads=job.get("cluster", {}).get("num_cpus_per_worker", 1))
    for shard in shards:
        worker.compute_shard(shard)
    return {"peak_rss_bytes": peak_memory(worker.engine.device)["peak_rss_bytes"], "notes": worker.engine.stats.notes}


def main(path: str) -> None:
    import logging

    import psutil

    # The zygote's imports, as a fresh driver or actor process has them before it builds a job.
    import classgrad.service.driver_runtime.preparation  # noqa: F401
    import classgrad.workers.actor_runtime.actor  # noqa: F401

    # transformers is imported once here rather than in every child (seconds each): a fresh process
    # imports it in its build, where the driver measures it; here neither child's build sees it, and
    # every child starts with it resident. What it added is reported (``preloaded_bytes``) for the
    # comparison to add back.
    before = psutil.Process().memory_info().rss
    try:
        import transformers.models.bert.modeling_bert  # noqa: F401
    except ImportError:
        pass
    preloaded = max(0, psutil.Process().memory_info().rss - before)
    logging.basicConfig(level=logging.WARNING)
    jobs = json.loads(Path(path).read_text())
    drivers = _in_children([lambda job=job: _driver(job) for job in jobs])
    actors = _in_children([lambda job=job, d=d: _actor(job, d["shards"]) for job, d in zip(jobs, drivers)])
    for driver, actor in zip(drivers, actors):
        print(json.dumps({"estimate": driver["footprint"], "preloaded_bytes": preloaded, **actor}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
